"""NATS: the request intake, the event relay onto JetStream and KV, the wire client, connecting
(connect.py) and secure mode's identities (auth.py) and their issuing (issuing.py)."""
