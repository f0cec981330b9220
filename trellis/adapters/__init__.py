"""Adapters: the engine's ports made concrete, grouped by what each drives.

- `postgres`: the event log, its migrations and the connection pools.
- `nats`: the intake of requests, the event relay (stream and KV bucket), the client.
- `fabric`: fabric drivers (the simulated fabric).
- `embedded`: the real nats-server and PostgreSQL started from pip packages.
- `entrypoints`: the `trellis` command and the demo.
- `bootstrap`, `settings`, `clock`: the one place that wires them to the engine;
  `endpoints`: where a local `trellis up` listens (endpoints.json).
"""
