"""The pure core: intents, events, state and evolve, decide and its parts, placement,
policy, queries, views, audit, Merkle trees, checkpoints. No asyncio, no I/O, no adapter
(enforced by ruff: pyproject.toml, flake8-tidy-imports)."""
