"""Secure mode's identities and permissions (adapters/nats/auth.py), without a server.

That nats-server enforces them is tested in tests/integration/test_secure_mode.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from core.fabric_builder import FabricBuilder, composed

from trellis.adapters.nats.auth import (
    CredentialsError,
    NkeyCredentials,
    Principal,
    SecureDir,
    UnknownTenant,
    authorization_config,
    inbox_prefix,
    new_seed,
    permissions,
    public_key,
    tenant_name_problem,
)
from trellis.adapters.nats.issuing import tenants_holding
from trellis.adapters.settings import Settings, SettingsError
from trellis.engine.core.state import DomainState

KEY = public_key(new_seed())


def allowed(principal: Principal, prefix: str = "trellis") -> tuple[list[str], list[str]]:
    rules = permissions(principal, KEY, prefix)
    assert rules is not None
    return rules["publish"]["allow"], rules["subscribe"]["allow"]


def test_a_tenant_may_publish_only_its_own_intents_and_views() -> None:
    publish, subscribe = allowed(Principal("tenant", "acme"))
    # ...and its own inbox, which only it reads (the echo of adapters/nats/roundtrip.py).
    assert publish == ["trellis.intent.*.acme.>", "trellis.view.*.acme.>", f"_INBOX.{KEY}.>"]
    assert subscribe == [f"_INBOX.{KEY}.>"]


def test_nobody_may_subscribe_to_every_inbox() -> None:
    for role in ("engine", "relay", "checkpoints", "operator", "auditor"):
        _, subscribe = allowed(Principal(role, role))  # type: ignore[arg-type]
        assert f"_INBOX.{KEY}.>" in subscribe
        assert not any(s.startswith("_INBOX.>") or s == ">" for s in subscribe)


def test_the_engine_publishes_only_replies_and_requests_it_forwards() -> None:
    publish, subscribe = allowed(Principal("engine", "engine"), "p1")
    assert publish == ["_INBOX.>", "p1.engine.>"]
    for family in ("intent", "admin", "query", "view", "engine"):
        assert f"p1.{family}.>" in subscribe


def test_only_the_relay_writes_the_stream_and_bucket_and_only_checkpoints_their_stream() -> None:
    writes = {
        "p1.events.>": "relay",
        "$KV.TRELLIS_STATE_p1.>": "relay",
        "$JS.API.STREAM.CREATE.TRELLIS_EVENTS_p1": "relay",
        "$JS.API.STREAM.CREATE.KV_TRELLIS_STATE_p1": "relay",
        "p1.checkpoints.>": "checkpoints",
        "$JS.API.STREAM.CREATE.TRELLIS_CHECKPOINTS_p1": "checkpoints",
    }
    roles = ["engine", "relay", "checkpoints", "operator", "auditor"]
    publishing = {role: allowed(Principal(role, role), "p1")[0] for role in roles}  # type: ignore[arg-type]
    publishing["tenant"] = allowed(Principal("tenant", "acme"), "p1")[0]
    for subject, writer in writes.items():
        assert [r for r, allow in publishing.items() if subject in allow] == [writer], subject
    wide = (">", "$JS.API.>", "$KV.>", "_INBOX.>")
    for role, allow in publishing.items():
        assert role == "engine" or not any(a in wide for a in allow), role


def test_the_operator_administers_queries_reads_the_feed_and_is_no_tenant() -> None:
    publish, subscribe = allowed(Principal("operator", "operator"), "p1")
    discovery = [
        f"$SRV.{v}.trellis-engine{one}" for v in ("PING", "INFO", "STATS") for one in ("", ".*")
    ]
    assert publish[:2] == ["p1.admin.>", "p1.query.>"] and publish[-1] == f"_INBOX.{KEY}.>"
    assert publish[-1 - len(discovery) : -1] == discovery
    # The stream and the bucket, read as the auditor reads them (the live fabric page)...
    reads = publish[2 : -1 - len(discovery)]
    assert "$JS.API.CONSUMER.CREATE.TRELLIS_EVENTS_p1.>" in reads
    assert "$JS.API.STREAM.INFO.KV_TRELLIS_STATE_p1" in reads
    changes = ("STREAM.CREATE", "STREAM.UPDATE", "STREAM.DELETE", "STREAM.PURGE", "MSG.DELETE")
    assert [s for s in reads if any(c in s for c in (*changes, "CONSUMER.DELETE", "$KV."))] == []
    # ...never a tenant's subjects, and replies on its own inbox only.
    assert not any(s.startswith(("p1.intent", "p1.view")) for s in publish)
    assert subscribe == [f"_INBOX.{KEY}.>"]
    tenant, _ = allowed(Principal("tenant", "acme"), "p1")
    assert not any(s.startswith("$SRV") for s in tenant)  # stats count every tenant's requests


def test_the_auditor_reads_streams_and_bucket_but_cannot_change_them() -> None:
    publish, subscribe = allowed(Principal("auditor", "auditor"), "p1")
    assert "p1.query.>" in publish
    assert not any(s.startswith(("p1.intent", "p1.admin", "p1.view", "p1.events")) for s in publish)
    assert "$JS.API.STREAM.INFO.TRELLIS_EVENTS_p1" in publish
    assert "$JS.API.STREAM.MSG.GET.TRELLIS_CHECKPOINTS_p1" in publish
    assert "$JS.API.DIRECT.GET.KV_TRELLIS_STATE_p1.>" in publish
    changes = ("STREAM.CREATE", "STREAM.UPDATE", "STREAM.DELETE", "STREAM.PURGE", "MSG.DELETE")
    changes += ("CONSUMER.DELETE", "$KV.")
    assert [s for s in publish if any(c in s for c in changes)] == []
    assert {"p1.events.>", "p1.checkpoints.>"} <= set(subscribe)


def test_the_config_holds_public_keys_only_and_is_json_inside() -> None:
    seed = new_seed()
    users = [(Principal("engine", "engine"), public_key(seed)), (Principal("tenant", "a"), KEY)]
    text = authorization_config(users, "trellis")
    assert seed not in text
    block = json.loads(text.split("authorization: ", 1)[1])
    assert block["users"][0]["nkey"] == public_key(seed)
    assert block["users"][0]["permissions"]["publish"]["allow"] == ["_INBOX.>", "trellis.engine.>"]
    assert block["users"][1]["permissions"]["publish"]["allow"][0] == "trellis.intent.*.a.>"


def test_seeds_are_user_nkeys_and_inboxes_follow_the_public_key() -> None:
    seed = new_seed()
    assert seed.startswith("SU") and public_key(seed).startswith("U")
    assert public_key(f"  {seed}\n") == public_key(seed)
    assert inbox_prefix(public_key(seed)) == f"_INBOX.{public_key(seed)}"
    assert new_seed() != seed
    for bad in ("", "not a seed", seed[:-2], "SAAB" + seed[4:]):
        with pytest.raises(CredentialsError):
            public_key(bad)


@pytest.mark.parametrize("name", ["acme\n", "a.b", "*", ">", "a b", "", "x" * 65, "operator"])
def test_names_that_cannot_be_a_tenant_are_refused(name: str) -> None:
    assert tenant_name_problem(name) is not None
    with pytest.raises(CredentialsError):
        SecureDir(Path("/nonexistent")).ensure("trellis", [name])


def test_ensure_issues_each_identity_once_and_privately(tmp_path: Path) -> None:
    secure = SecureDir(tmp_path)
    assert not secure.exists() and secure.prefix() is None
    assert secure.ensure("p1", ["acme"]) == ["acme"]
    seeds = {p: p.read_text() for p in secure.root.rglob("*.nk")}
    assert {p.relative_to(secure.root).as_posix() for p in seeds} == {
        "engine.nk", "relay.nk", "checkpoints.nk", "operator.nk", "auditor.nk", "tenants/acme.nk"
    }  # fmt: skip

    assert secure.ensure("p1", ["acme", "globex"]) == ["globex"]
    assert all(p.read_text() == seed for p, seed in seeds.items())  # never re-issued
    assert secure.exists() and secure.prefix() == "p1" and secure.tenants() == ["acme", "globex"]
    assert secure.root.stat().st_mode & 0o777 == 0o700
    for path in secure.root.rglob("*"):
        if path.is_file():
            assert path.stat().st_mode & 0o777 == 0o600, path
    config = secure.config_path.read_text()
    for name in ("engine", "operator", "auditor", "acme", "globex"):
        key = public_key(secure.credentials(_principal(name)).seed())
        assert f'"nkey": "{key}"' in config


def test_revoke_sets_the_seed_aside_and_writes_the_config_without_its_user(
    tmp_path: Path,
) -> None:
    secure = SecureDir(tmp_path)
    secure.ensure("p1", ["acme", "globex"])
    acme, globex = (
        public_key(secure.credentials(_principal(n)).seed()) for n in ("acme", "globex")
    )
    assert [(n, k) for n, k, _ in secure.identities()] == [("acme", acme), ("globex", globex)]

    aside = secure.revoke("acme", "p1")

    assert aside == secure.root / "revoked" / f"acme.{acme}.nk"
    assert aside.stat().st_mode & 0o777 == 0o600 and aside.parent.stat().st_mode & 0o777 == 0o700
    assert [n for n, _, _ in secure.identities()] == ["globex"]
    config = secure.config_path.read_text()
    assert acme not in config and globex in config and "p1.intent.*.acme.>" not in config
    with pytest.raises(UnknownTenant, match="'acme' has no identity"):
        secure.revoke("acme", "p1")
    with pytest.raises(CredentialsError, match="internal identity"):
        secure.revoke("operator", "p1")
    assert secure.ensure("p1", ["acme"]) == ["acme"]  # a new identity, the old one set aside
    assert public_key(secure.credentials(_principal("acme")).seed()) != acme


def test_a_restart_issues_no_identity_again_to_a_tenant_the_operator_revoked(
    tmp_path: Path,
) -> None:
    """`up` issues identities to tenants holding live compositions: a revoked one holding one
    was let back in by the next restart (an upgrade, say), under a new key (upgrade probe)."""
    secure = SecureDir(tmp_path)
    secure.ensure("p1", ["acme", "globex"])
    engine = _Holding({"acme", "globex", "initech"})
    assert tenants_holding(engine, secure) == ["acme", "globex", "initech"]

    secure.revoke("acme", "p1")

    assert secure.revoked() == {"acme"}
    assert tenants_holding(engine, secure) == ["globex", "initech"]
    secure.ensure("p1", ["acme"])  # `tenant add` again: the operator's say
    assert secure.revoked() == set() and "acme" in tenants_holding(engine, secure)


class _Holding:
    """What tenants_holding reads of an engine: one domain whose compositions are `tenants`'."""

    def __init__(self, tenants: set[str]):
        b = FabricBuilder().host("h").switch("s").link("h", "s")
        for n in range(len(tenants)):
            b.gpu(f"g{n}").link("s", f"g{n}")
        state = b.state()
        for tenant in sorted(tenants):
            state, _ = composed(state, tenant, host="h", devices=[{"kind": "gpu"}])
        self.domains = [state.domain]
        self._state = state

    def state(self, domain: str) -> DomainState | None:
        return self._state if domain == self._state.domain else None


def test_a_revoke_whose_config_cannot_be_written_keeps_the_identity(tmp_path: Path) -> None:
    secure = SecureDir(tmp_path)
    secure.ensure("p1", ["acme"])
    config = secure.config_path.read_text()
    (secure.root / ".auth.conf.tmp").mkdir()  # where the new config would be written first
    with pytest.raises(OSError):
        secure.revoke("acme", "p1")
    assert secure.tenants() == ["acme"] and secure.config_path.read_text() == config
    assert not list((secure.root / "revoked").iterdir())


def test_tenants_added_at_once_are_all_in_the_config(tmp_path: Path) -> None:
    secure = SecureDir(tmp_path)
    names = [f"t{i}" for i in range(8)]
    threads = [threading.Thread(target=secure.ensure, args=("p", [n])) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    config = secure.config_path.read_text()
    assert all(f"p.intent.*.{n}.>" in config for n in names)


def test_credentials_say_what_is_wrong_with_a_file(tmp_path: Path) -> None:
    missing = NkeyCredentials(tmp_path / "missing.nk")
    with pytest.raises(CredentialsError, match="cannot read"):
        missing.connect_options()
    jwt = tmp_path / "user.creds"
    jwt.write_text("-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n")
    with pytest.raises(CredentialsError, match="JWT"):
        NkeyCredentials(jwt).connect_options()
    garbage = tmp_path / "garbage.nk"
    garbage.write_text("hello")
    with pytest.raises(CredentialsError, match="not an nkey seed"):
        NkeyCredentials(garbage).connect_options()
    good = tmp_path / "good.nk"
    seed = new_seed()
    good.write_text(seed + "\n")
    assert NkeyCredentials(good).connect_options() == {
        "nkeys_seed": str(good),
        "inbox_prefix": inbox_prefix(public_key(seed)),
    }


def test_trellis_secure_turns_secure_mode_on() -> None:
    assert Settings.from_env({}).secure is False
    assert Settings.from_env({"TRELLIS_SECURE": "1"}).secure is True
    assert Settings.from_env({"TRELLIS_SECURE": "false"}).secure is False
    with pytest.raises(SettingsError, match="TRELLIS_SECURE"):
        Settings.from_env({"TRELLIS_SECURE": "maybe"})


def _principal(name: str) -> Principal:
    if name in ("engine", "operator", "auditor"):
        return Principal(name, name)  # type: ignore[arg-type]
    return Principal("tenant", name)
