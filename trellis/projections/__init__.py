"""Projections: read models folded from the event log, checkpointed and rebuildable.

- `table`: projection tables as a batch's fold sees them (bulk fetch, change, bulk write).
- `compositions`, `connections`, `devices`: one projection each, a `match` arm per event.
- `sink`: `ProjectionSink`, what a domain's log follower (engine.service.follower) folds into, and
  `rebuild`.
- `replay`: a rebuild's rows, carried in memory from batch to batch and written with COPY.
- `read_models`: `PostgresReadModels`, engine.service.ports.ReadModels over the tables.

This layer imports engine/ and asyncpg, never adapters/: the log comes in through the follower's
small `DomainLog` protocol (PostgresEventStore satisfies it).
"""

from trellis.projections.read_models import PostgresReadModels
from trellis.projections.sink import ProjectionSink, default_projections, rebuild

__all__ = ["PostgresReadModels", "ProjectionSink", "default_projections", "rebuild"]
