"""The cluster's state in Redis: the node registry with heartbeats (`registry`), the prefix-cache
location index (`kv_index`) and the embedded Redis server (`embedded_redis`).

A low layer: below the gateway and the services, above the engine (whose `EngineLoad` the
registry stores); it imports no service."""
