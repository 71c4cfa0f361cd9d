"""pdserve: disaggregated (prefill/decode) LLM serving.

This package is the composition root: the `pdserve` command line (`cli`), the one definition of
every option (`options`), the node runtime (`node`) and the process supervisor (`launcher`).
Under it live the shared engine core (`engine`, the lowest layer), the Redis layer
(`cluster_state`) and the benchmarks (`bench`). Importing `pdserve` itself imports nothing.
"""
