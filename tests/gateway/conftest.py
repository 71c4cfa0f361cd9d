"""Gateway fixtures: the default model's real tokenizer and served model, a FakeBackend playing
the tokens of DEFAULT_TEXT, the app behind a TestClient, and a real uvicorn server on a free port."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient

from gateway import app as gateway_app
from gateway.app import create_app
from gateway.served_model import ServedModel, load_served_model
from gateway.server import uvicorn_config
from gateway.settings import GatewaySettings
from gateway.tokenizer import Tokenizer
from pdserve.engine.model_loader import DEFAULT_MODEL, resolve_model
from tests.gateway.fakes import DEFAULT_TEXT, FakeBackend, text_chunks


@pytest.fixture(scope="session")
def default_model_path():
    try:
        return resolve_model(DEFAULT_MODEL).path
    except ValueError as exc:
        pytest.skip(f"the default model is not available: {exc}")


@pytest.fixture(scope="session")
def tokenizer(default_model_path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_path)


@pytest.fixture(scope="session")
def settings(default_model_path) -> GatewaySettings:
    return GatewaySettings(model=str(default_model_path), served_model_name="smollm2", max_model_len=256)


@pytest.fixture(scope="session")
def served_model(settings) -> ServedModel:
    return load_served_model(settings)


@pytest.fixture
def backend(tokenizer) -> FakeBackend:
    return FakeBackend(text_chunks(tokenizer, DEFAULT_TEXT))


@pytest.fixture
def app(settings, backend, served_model, monkeypatch):
    # The lifespan still runs; it just reuses the session's tokenizer instead of parsing it per test.
    monkeypatch.setattr(gateway_app, "load_served_model", lambda _settings: served_model)
    return create_app(settings, backend)


@pytest.fixture
def client(app):
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def live_server(settings, backend):
    """A real uvicorn server on 127.0.0.1 (a free port) running the app with the fake backend;
    yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # What serve_gateway serves; host and port give way to `sock`.
    server = uvicorn.Server(uvicorn_config(settings, backend))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()
