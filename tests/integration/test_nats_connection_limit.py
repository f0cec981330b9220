"""The embedded nats-server refuses connections past half its open-files limit, so a flood of
connections (one tenant's key may open as many as it likes: every identity is a user of one
account) is refused before JetStream's store runs out of files (the hostile-tenant probe held
5,000 of one tenant's connections)."""

from __future__ import annotations

import resource
from pathlib import Path

from trellis.adapters.embedded.nats_server import EmbeddedNats, max_connections


def test_the_limit_is_half_the_open_files_within_nats_own_bounds() -> None:
    assert max_connections(20_000) == 10_000
    assert max_connections(1_000_000) == 65_536  # nats-server's own default
    assert max_connections(100) == 64


def test_the_embedded_server_runs_with_the_limit(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    try:
        varz = server.monitor("varz")
    finally:
        server.stop()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert varz["max_connections"] == max_connections(hard), varz["max_connections"]
