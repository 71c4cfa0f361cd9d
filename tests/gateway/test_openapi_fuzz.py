"""Schemathesis over /openapi.json against the app with the fake backend, for a bounded number of
examples per operation: no 5xx, and every status the API answers is one the schema documents."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (hypothesis comes with schemathesis)

MAX_EXAMPLES = 30  # per operation and mode: valid bodies, and bodies that break the schema


def test_no_server_error_and_only_documented_statuses(client, app):
    """`client` runs the app's lifespan; schemathesis then calls the app over ASGI."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.path for operation in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    for operation in operations:
        fuzz(operation, schemathesis.GenerationMode.POSITIVE)
        if "requestBody" in operation.definition.raw:  # nothing to break in a call without a body
            fuzz(operation, schemathesis.GenerationMode.NEGATIVE)


def fuzz(operation, mode) -> None:
    documented = set(operation.definition.raw["responses"])

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        response = case.call()
        where = f"{case.method} {case.path} {case.body!r:.300}"
        assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:300]}"
        assert str(response.status_code) in documented, f"{where}: undocumented {response.status_code}"

    check()
