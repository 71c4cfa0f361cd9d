"""How uvicorn serves the gateway: HTTP parsed by httptools (C), not h11 (Python), which cut the
gateway's CPU per streamed token by ~15% on the 2-core AMD EPYC (docs/benchmarks.md)."""

from __future__ import annotations

from gateway.server import uvicorn_config


def test_the_gateway_parses_http_with_httptools(settings, backend):
    config = uvicorn_config(settings, backend)
    config.load()
    assert config.http_protocol_class.__module__ == "uvicorn.protocols.http.httptools_impl"
