"""Moves a request's KV pages from the prefill node to the decode node.

One small interface (`base.py`: a sender opens one layer-wise stream per request; a receiver
checks and stores what arrives), one file per transport: gRPC streaming (`grpc_transport.py`),
same-host shared memory (`shm_transport.py`), same-host GPU to GPU through CUDA IPC
(`cuda_ipc_transport.py`, with the handle's export and open in `cuda_ipc.py`) and an in-process
fake for unit tests (`fake.py`);
the prefill side's `LeaseKeeper` (`lease_keeper.py`) renews the receiver's reservations while
the prompts wait."""
