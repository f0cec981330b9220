"""PostgreSQL: the append-only event log (store), its migrations and connection pools."""
