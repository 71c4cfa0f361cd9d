"""Moves a request's KV pages from the prefill node to the decode node.

One small interface (`base.py`), one file per transport: gRPC streaming (`grpc_transport.py`)
and an in-process fake for unit tests (`fake.py`)."""
