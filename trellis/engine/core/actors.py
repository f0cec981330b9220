"""Who acts on a domain: tenants, and Trellis's own internal actors.

The actor of an intent is the tenant token of its subject, or an internal actor: `operator`
for the admin subjects and `engine` for what the engine decides on its own (lease expiry,
settling a saga). Request ids are scoped by actor, so a tenant could take an internal actor's
request ids only by taking its name: internal names are therefore reserved, as is every token
that starts with `_`, the namespace for internal actors to come. Case does not matter, so that
no tenant `Engine` can pass for the engine in a log an auditor reads.
"""

from __future__ import annotations

ENGINE = "engine"  # expiries, settlements: what the engine records on its own
OPERATOR = "operator"  # the admin subjects
AUDITOR = "auditor"  # reads only; named here so no tenant takes the name

INTERNAL_ACTORS = frozenset({ENGINE, OPERATOR, AUDITOR})
INTERNAL_PREFIX = "_"


def is_reserved(token: str) -> bool:
    """True when no tenant may use `token`: it names, or could name, an internal actor."""
    return token.lower() in INTERNAL_ACTORS or token.startswith(INTERNAL_PREFIX)
