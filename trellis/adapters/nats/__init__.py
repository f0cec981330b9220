"""NATS: the request intake, the event relay onto JetStream and KV, and the wire client."""
