"""Configuration from the environment (README: Configuration)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from engine.ids import is_valid_id


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str | None = None
    database_url: str | None = None
    data_dir: Path | None = None
    domains: list[str] | None = None
    subject_prefix: str = "trellis"
    db_schema: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Read TRELLIS_* variables; unset URLs mean "start the embedded servers"."""
        env = dict(os.environ if env is None else env)
        domains = [d.strip() for d in env.get("TRELLIS_DOMAINS", "").split(",") if d.strip()]
        bad = [d for d in domains if not is_valid_id(d)]
        if bad:
            raise ValueError(f"TRELLIS_DOMAINS holds invalid ids: {', '.join(bad)}")
        data_dir = env.get("TRELLIS_DATA_DIR")
        return cls(
            nats_url=env.get("TRELLIS_NATS_URL") or None,
            database_url=env.get("TRELLIS_DATABASE_URL") or None,
            data_dir=Path(data_dir) if data_dir else None,
            domains=domains or None,
            subject_prefix=env.get("TRELLIS_SUBJECT_PREFIX") or "trellis",
            db_schema=env.get("TRELLIS_DB_SCHEMA") or None,
        )
