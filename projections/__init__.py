"""Projections: read models folded from the event log, checkpointed and rebuildable."""
