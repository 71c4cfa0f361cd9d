"""What a replica registers for others to dial, and why two containers never pick shared memory."""

from __future__ import annotations

import pytest

from kvtransfer import shm_transport
from pdserve import node
from pdserve.node import advertised_host


@pytest.fixture
def container(monkeypatch):
    """A container named 3f2a9c1d0b7e whose address on the compose network is 172.18.0.5."""
    monkeypatch.setattr(node.socket, "gethostname", lambda: "3f2a9c1d0b7e")
    monkeypatch.setattr(node.socket, "gethostbyname", {"3f2a9c1d0b7e": "172.18.0.5"}.__getitem__)


def test_auto_advertises_the_containers_own_address(container):
    assert advertised_host("0.0.0.0", "auto") == "172.18.0.5"


def test_a_wildcard_bind_without_an_advertised_host_advertises_the_own_address(container):
    assert advertised_host("0.0.0.0", None) == "172.18.0.5"
    assert advertised_host("::", None) == "172.18.0.5"


def test_an_explicit_advertised_host_or_a_specific_bind_is_kept(container):
    assert advertised_host("0.0.0.0", "node-a.example.net") == "node-a.example.net"
    assert advertised_host("127.0.0.1", None) == "127.0.0.1"


def test_two_containers_on_one_machine_have_different_kv_host_ids(monkeypatch):
    # Same kernel (boot id), different hostnames: what two replicas see. Equal ids would mean shared memory.
    ids = []
    for hostname in ("3f2a9c1d0b7e", "81d0c4e5aa12"):
        shm_transport.host_id.cache_clear()
        monkeypatch.setattr(shm_transport.socket, "gethostname", lambda name=hostname: name)
        ids.append(shm_transport.host_id())
    shm_transport.host_id.cache_clear()
    assert ids[0] != ids[1]
