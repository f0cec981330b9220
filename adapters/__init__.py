"""Adapters: concrete ports for Postgres, NATS, the fabric driver and the embedded servers."""
