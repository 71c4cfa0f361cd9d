"""Triton kernels for GPU nodes (`--attention-backend triton`).

They run on CUDA; `make test` runs them on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set by the tests' conftest before triton is imported), against the torch
backend. Import this package only where the triton backend is chosen: triton is heavy, and the
gateway never needs it.
"""
