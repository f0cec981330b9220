"""Projections: read models folded from the event log, checkpointed and rebuildable.

- `table`: projection tables as a batch's fold sees them (bulk fetch, change, bulk write).
- `compositions`, `connections`, `devices`: one projection each, a `match` arm per event.
- `runner`: `ProjectionRunner` follows the log and commits rows with checkpoints; `rebuild`.
- `read_models`: `PostgresReadModels`, engine.ports.ReadModels over the tables.

This layer imports engine/ and asyncpg, never adapters/: the log comes in through a small
`EventSource` protocol (PostgresEventStore satisfies it).
"""

from projections.read_models import PostgresReadModels
from projections.runner import ProjectionRunner, ProjectionStalled, default_projections

__all__ = ["PostgresReadModels", "ProjectionRunner", "ProjectionStalled", "default_projections"]
