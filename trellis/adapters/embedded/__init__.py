"""The embedded default: real nats-server and PostgreSQL processes from pip packages."""
