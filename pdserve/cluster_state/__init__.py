"""The cluster's state in Redis: the node registry with heartbeats (`registry`), the prefix-cache
location index (`kv_index`) and the embedded Redis server (`embedded_redis`).

A low layer: it imports the engine and the protos' data classes at most, never a service."""
