"""The prefill role's choices for the node runtime."""

from __future__ import annotations

from prefill_service.server import PrefillNodeService


def test_a_prefill_node_keeps_a_local_cache_and_pushes_from_its_layer_hook():
    service = PrefillNodeService("auto", kv_lease_s=10.0)
    assert service.kv_storage is None
    assert service.layer_hook == service.pushes.on_layer_computed
    assert service.kv_lease_s == 10.0  # its lease keeper's period until a decode node states its own
