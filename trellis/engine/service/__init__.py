"""The async engine service: the router, domain custody, query answers, the writer (group
commit), the saga, the follower, ownership, snapshots; ports.py holds the Protocols it
drives adapters through."""
