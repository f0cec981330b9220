"""`trellis verify`: prove the log intact and the read models true to it, from the database.

The checks, one pass over each domain's log (docs/auditing.md, "Verifying the log"):

- chain: every event's sha256 hash, its link to the one before, gap-free versions from the
  genesis hash, the stream head where the chain ends (engine.core.audit.ChainCheck), and every
  stored Merkle checkpoint's root recomputed from the log (engine.core.audit.CheckpointCheck);
- notes: every stored checkpoint's signed note verifies with one of the deployment's verifier
  keys, says its row's origin, size and root, and signed a root the log gives. The keys are
  every --key and --key-file (after a key rotation, the old and the new), else `<key
  file>.pub` beside the signing key of this data dir, else what the engine answers to the
  `checkpoint-key` query; without one the check is skipped, and said so;
- invariants: the independent audit over the raw event data (engine.core.audit.InvariantAudit);
- projections: the whole log replayed into fresh projection tables, compared row by row with
  the live ones, each up to the version its live checkpoint says it holds;
- kv: the log folded as the relay folds it (kv_state.fold), rendered as it renders the bucket, and
  compared with what TRELLIS_STATE holds, up to the relay's checkpoint. Skipped (and said so)
  when NATS cannot be reached;
- stream: every message of the domain in TRELLIS_EVENTS that claims to be an event is the
  log's at its version, and carried once; the log's events reach its head and what the relay
  says it published. Foreign messages are counted; events a failover's lost tail left before
  the relay's republication are counted apart (adapters/nats/stream_audit.py).

A part that is behind the log (a projection, or the relay, which fills the stream and the
bucket) is a finding, never a pass: verify first waits up to `--wait` seconds (5) for every
part to reach the head it read, so a live engine's usual few milliseconds do not count.

Exit 0: no findings; 1: findings; 2: verify could not run, 3: Postgres cannot be reached (one
line on stderr). `-o json` prints the report as one JSON document. Nothing is written anywhere
but temporary tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats.errors

from trellis.adapters.bootstrap import checkpoint_key_path
from trellis.adapters.checkpoint_key import public_key_path
from trellis.adapters.embedded.process import default_data_dir
from trellis.adapters.endpoints import find_endpoint
from trellis.adapters.entrypoints import audit_proofs, render
from trellis.adapters.entrypoints.cli.errors import EXIT_UNAVAILABLE, CliError, no_database
from trellis.adapters.nats import kv_audit, kv_state, stream_audit
from trellis.adapters.nats.auth import CredentialsError, NkeyCredentials, Principal, SecureDir
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import nats_servers
from trellis.adapters.nats.jetstream import DomainEnd, domain_end, stream_name
from trellis.adapters.nats.kv_state import View, changes, coalesce, everything
from trellis.adapters.postgres import sessions
from trellis.adapters.postgres import verify as db
from trellis.adapters.postgres.migrations import require_current
from trellis.adapters.postgres.store import connect_pool
from trellis.adapters.settings import Settings, SettingsError
from trellis.engine.core.audit import (
    ChainCheck,
    CheckpointCheck,
    Finding,
    InvariantAudit,
    StoredCheckpoint,
)
from trellis.engine.core.checkpoints import NoteError, Verifier
from trellis.engine.core.records import RecordedEvent
from trellis.projections.base import Fact
from trellis.projections.sink import default_projections

CHECKS = ("chain", "notes", "invariants", "projections", "kv", "stream")
#: Seconds verify waits for the projections and the relay to reach the log's head.
CATCH_UP_S = 5.0
_POLL_S = 0.1
NATS_TIMEOUT_S = 3.0


class CannotRun(Exception):
    """Verify could not do its work (no such domain, no log in that schema, ...): exit 2, one
    line. No database configured at all is `unavailable` (3), as for every command."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", help="only this domain (default: every domain)")
    render.add_output_options(parser)  # the report; wide is the table
    parser.add_argument(
        "--creds", type=Path, help="NATS credentials for the KV check (default: the auditor's)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=CATCH_UP_S,
        metavar="SECONDS",
        help="how long the projections and the relay may take to reach the log's head before "
        f"being behind counts as a finding (default {CATCH_UP_S:g})",
    )


def run(args: argparse.Namespace) -> int:
    """`trellis verify`; with --proof or --checkpoint, the offline proof check instead (no
    database: adapters/entrypoints/audit_proofs.py)."""
    if getattr(args, "proof", None) is not None or getattr(args, "checkpoint", None):
        return audit_proofs.verify_offline(args)
    try:
        settings = Settings.from_env()
        url = find_endpoint(settings, "database_url")
        if url is None:
            raise no_database()  # the outage line and exit 3, as every command's
        keys, key_from = _verifier_keys(args, settings)
        report = asyncio.run(
            verify(
                url,
                schema=settings.db_schema,
                nats_url=find_endpoint(settings, "nats_url"),
                prefix=settings.subject_prefix,
                domain=args.domain,
                credentials=_credentials(settings, args.creds),
                wait=args.wait,
                keys=keys,
                key_from=key_from,
            )
        )
    except (CannotRun, SettingsError, CredentialsError, LookupError) as exc:
        print(f"trellis verify: {exc}", file=sys.stderr)
        return 2
    except ConnectionError:
        raise  # nothing listens: the CLI's one `unavailable` line (exit 3)
    except nats.errors.TimeoutError:  # before TimeoutError, which it is too: not the database
        print(
            "trellis verify: NATS did not answer a read of the stream, the bucket or the "
            "engine in time (hint: a tenant's identity may read none of them; the operator's "
            "or the auditor's does, --creds)",
            file=sys.stderr,
        )
        return 2
    except TimeoutError:  # a stalled Postgres is an outage: exit 3, as every command says it
        raise CliError(
            "Postgres did not answer in time",
            code="unavailable",
            hint="is Postgres stalled or overloaded? verify reads the log and the projections",
            exit=EXIT_UNAVAILABLE,
        ) from None
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        print(
            f"trellis verify: cannot read the database: {str(exc) or type(exc).__name__}",
            file=sys.stderr,
        )
        return 2
    if args.output == "json":
        print(msgspec.json.format(msgspec.json.encode(report), indent=2).decode())
    else:
        print(text(report))
    return 0 if report["ok"] else 1


# ---- the audit ----


@dataclass
class _Check:
    status: str = "pass"  # pass, fail, skipped
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def found(self, findings: list[Finding]) -> None:
        if findings:  # a failure in one domain outweighs a skip in another
            self.status = "fail"

    def skip(self, reason: str) -> None:
        if self.status != "fail":
            self.status, self.reason = "skipped", reason

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status}
        if self.reason:
            out["reason"] = self.reason
        return out | self.details


async def verify(
    database_url: str,
    *,
    schema: str | None = None,
    nats_url: str | None = None,
    prefix: str = "trellis",
    domain: str | None = None,
    credentials: NkeyCredentials | None = None,
    wait: float = CATCH_UP_S,
    keys: Sequence[Verifier] = (),
    key_from: str = "",
) -> dict[str, Any]:
    """Run every check over the log in `schema` (and the bucket and stream for `prefix`); the
    report. The projections and the relay get `wait` seconds to reach each domain's head.
    Each stored note must verify with one of `keys` (`key_from` says where they came from),
    else with the key the engine answers to the `checkpoint-key` query (`key_from` then says
    where none was found before).

    Raises:
        CannotRun: `domain` is not in the log.
        LookupError: there is no Trellis log in that schema.
    """
    # The reader sits idle in its snapshot while a batch is folded on the other connection.
    pool = await connect_pool(
        database_url,
        schema=schema,
        min_size=2,
        max_size=2,
        idle_in_transaction_s=600.0,
        application_name=sessions.COMMAND,
    )
    try:
        async with pool.acquire() as reader, pool.acquire() as scratch:
            await require_current(reader)
            return await _verify(
                reader, scratch, nats_url, prefix, domain, credentials, wait, keys, key_from
            )
    finally:
        await pool.close()


async def _verify(
    reader: asyncpg.Connection,
    scratch: asyncpg.Connection,
    nats_url: str | None,
    prefix: str,
    only: str | None,
    credentials: NkeyCredentials | None,
    wait: float,
    keys: Sequence[Verifier],
    key_from: str,
) -> dict[str, Any]:
    live = await db.live_schema(reader)
    domains = await db.domains(reader)
    if only is not None:
        if only not in domains:
            raise CannotRun(f"the log has no domain {only!r}")
        domains = [only]
    checks = {name: _Check() for name in CHECKS}
    projections = default_projections()
    replay = db.ProjectionReplay(scratch, live, projections)
    await replay.prepare()
    js, nc, why_not = await _jetstream(nats_url, credentials)
    if js is None:
        checks["kv"].skip(why_not)
        checks["stream"].skip(why_not)
    report_domains: dict[str, Any] = {}
    try:
        if not keys and domains:
            key, answer = await _engine_key(nc, why_not, prefix, domains[0])
            keys = [key] if key is not None else []
            key_from = answer if key is not None else "; ".join(filter(None, [key_from, answer]))
        notes = checks["notes"]
        notes.details["notes"] = 0
        if not keys:
            notes.skip(f"no verifier key: {key_from or 'the log has no domain'}")
        else:
            keys = list(dict.fromkeys(keys))  # a key given twice is named once
            named = [key.key() for key in keys]
            # `key` (the first) stays for reports' readers from before keys were repeatable.
            notes.details |= {"key": named[0], "keys": named, "key_from": key_from}
        for domain in domains:
            report_domains[domain] = await _domain(
                reader, scratch, replay, js, prefix, domain, checks, wait, keys
            )
    finally:
        if nc is not None:
            await nc.close()
    checks["chain"].details["events"] = sum(d["events"] for d in report_domains.values())
    if not all(d["keeps_checkpoints"] for d in report_domains.values()):
        checks["chain"].details["checkpoints"] = "this database keeps no Merkle checkpoints"
    ok = not any(d["findings"] for d in report_domains.values())
    for d in report_domains.values():
        del d["events"], d["keeps_checkpoints"]
    return {
        "ok": ok,
        "domains": report_domains,
        "checks": {name: check.report() for name, check in checks.items()},
    }


async def _domain(
    reader: asyncpg.Connection,
    scratch: asyncpg.Connection,
    replay: db.ProjectionReplay,
    js: Any,
    prefix: str,
    domain: str,
    checks: dict[str, _Check],
    wait: float,
    keys: Sequence[Verifier],
) -> dict[str, Any]:
    names = [p.name for p in default_projections()]
    relay_name = f"relay:{stream_name(prefix)}"
    # What the followers must reach; the chain is checked against the head in its snapshot.
    head_version = ((await db.stream_head(reader, domain)) or (0, 0, ""))[0]
    followers = [*names, relay_name] if js is not None else names
    applied = await _caught_up(reader, followers, domain, head_version, wait)
    upto = {name: applied.get(name, (0, 0))[0] for name in names}
    relayed = applied.get(relay_name, (0, 0))
    # Read before the log's snapshot: every event of the log up to it is in the snapshot.
    end = await domain_end(js, prefix, domain) if js is not None else None

    chain = ChainCheck(domain)
    invariants = InvariantAudit(domain)
    fold = _Fold(domain, relay_version=relayed[0])
    replay.start()
    async with db.snapshot(reader, domain) as seen:
        stored = seen.checkpoints or []
        anchors = CheckpointCheck(domain, stored, keys)
        async for batch in seen.events():
            facts = []
            for record in batch:
                chain.feed(record)
                anchors.feed(record)
                try:
                    data = json.loads(record.data)
                except ValueError as exc:
                    fold.stop(record, f"its data is no JSON: {exc}")
                    continue
                invariants.feed(record.position, record.version, record.type, data)
                fact = fold.feed(record)
                if fact is not None:
                    facts.append(fact)
            if facts and not fold.stopped:
                try:
                    await replay.feed(facts, upto)
                except Exception as exc:  # a projection's fold refuses what the log holds
                    why = f"the projections cannot fold this batch: {exc!r}"
                    fold.stop(facts[0].record, why)

    findings = list(chain.findings)
    head = seen.head
    if head is None:
        findings.append(
            Finding(check="stream_head", domain=domain, message="the domain has no stream head")
        )
    elif (stale := chain.head_finding(*head)) is not None:
        findings.append(stale)
    findings += anchors.findings()
    checks["chain"].found(findings)
    signed = anchors.note_findings()
    checks["notes"].details["notes"] += len(stored)
    checks["notes"].found(signed)
    findings += signed
    checks["invariants"].found(invariants.findings)
    findings += invariants.findings
    checks["projections"].found(fold.findings)  # the replay could not go on
    findings += fold.findings

    differences = await _projections(scratch, replay, domain, names, upto, fold, checks)
    findings += differences
    behind = [
        _behind("projections", domain, f"projection {name}", upto[name], head_version, wait)
        for name in names
        if upto[name] < head_version
    ]
    checks["projections"].found(behind)
    findings += behind
    if js is not None:
        findings += await _kv(reader, js, prefix, domain, relay_name, relayed, fold, checks)
        if relayed[0] < head_version:
            lag = [_behind("kv", domain, "the relay", relayed[0], head_version, wait)]
            checks["kv"].found(lag)
            findings += lag
        assert end is not None
        stream = await _stream(reader, js, prefix, domain, end, relayed[0], head_version, checks)
        findings += stream
    return {
        "head": {"version": chain.version, "position": chain.position, "hash": chain.hash},
        "latest_checkpoint": _latest(stored),
        "findings": [msgspec.to_builtins(f) for f in findings],
        "events": chain.count,
        "keeps_checkpoints": seen.checkpoints is not None,
    }


def _latest(stored: list[StoredCheckpoint]) -> dict[str, Any] | None:
    """The latest stored checkpoint as the report prints it, to be written down elsewhere."""
    if not stored:
        return None
    latest = stored[-1]
    return {
        "size": latest.size,
        "root": latest.root,
        "recorded_at": latest.recorded_at.isoformat() if latest.recorded_at else None,
        "note": latest.note,
    }


class _Fold:
    """The relay's fold (kv_state.fold: engine.core.state.evolve and the conditions) over the
    domain's events, noting what the relay would have put in
    the bucket by its checkpoint: the state there and the position each key last changed at."""

    def __init__(self, domain: str, relay_version: int):
        self.state = View.empty(domain)
        self.relay_version = relay_version
        self.at_relay = self.state if relay_version == 0 else None
        self.written_at: dict[str, int] = {}
        self.findings: list[Finding] = []
        self.stopped = False
        self.version = 0

    def feed(self, record: RecordedEvent) -> Fact | None:
        """Fold one event; its Fact for the projections, or None once the fold has stopped."""
        if self.stopped:
            return None
        try:
            event = record.event()
            before = self.state
            self.state = kv_state.fold(before, event, record.recorded_at, record.position)
        except Exception as exc:  # an event this code cannot read, or a forged log's
            self.stop(record, f"the engine's fold cannot apply it: {type(exc).__name__}: {exc}")
            return None
        self.version = record.version
        if record.version <= self.relay_version:
            for key, _ in changes(before, self.state, event, record.position):
                self.written_at[key] = record.position
            if record.version == self.relay_version:
                self.at_relay = self.state
        return Fact(record, event)

    def stop(self, record: RecordedEvent, why: str) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.findings.append(
            Finding(
                check="replay",
                domain=record.domain,
                position=record.position,
                version=record.version,
                message=f"event {record.version} (position {record.position}): {why}; the "
                "replay stops there",
            )
        )


async def _projections(
    scratch: asyncpg.Connection,
    replay: db.ProjectionReplay,
    domain: str,
    names: list[str],
    upto: dict[str, int],
    fold: _Fold,
    checks: dict[str, _Check],
) -> list[Finding]:
    """Compare in one snapshot with the checkpoints read there: the projections may have moved
    on while the log was read, so the replay first catches up to where they are now."""
    check = checks["projections"]
    if fold.stopped:
        return []  # the replay is incomplete: every row after the stop would differ
    async with scratch.transaction(isolation="repeatable_read"):
        now = await db.follower_checkpoints(scratch, names, domain)
        target = {name: now.get(name, (0, 0))[0] for name in names}
        if any(target[n] < upto[n] for n in names):
            check.skip("the projections were rebuilt while verify ran; run it again")
            return []
        if target != upto:
            # Decoding needs no state; `feed` takes each projection's own range of them.
            records = await db.events_between(
                scratch, domain, min(upto.values()), max(target.values())
            )
            await replay.feed([Fact(r, r.event()) for r in records], target)
        findings = await replay.compare(domain)
    compared = check.details.setdefault("compared_up_to", {})
    compared[domain] = target
    check.found(findings)
    return findings


async def _kv(
    reader: asyncpg.Connection,
    js: Any,
    prefix: str,
    domain: str,
    relay_name: str,
    relayed: tuple[int, int],
    fold: _Fold,
    checks: dict[str, _Check],
) -> list[Finding]:
    check = checks["kv"]
    if fold.at_relay is None:
        check.skip(f"{domain}: the relay's checkpoint is beyond what the log could be folded to")
        return []
    try:
        actual = await kv_audit.bucket_entries(js, prefix, domain)
    except Exception as exc:  # no bucket, no permission, NATS gone mid-way
        check.skip(f"cannot read the bucket: {type(exc).__name__}: {exc}")
        return []
    after = (await db.follower_checkpoints(reader, [relay_name], domain)).get(relay_name, (0, 0))
    if after != relayed:
        check.skip("the relay moved on while verify read the bucket; run it again when quiet")
        return []
    expected = {
        key: values[-1]
        for key, values in coalesce(everything(fold.at_relay, 0)).items()
        if values[-1] is not None
    }
    findings = kv_audit.compare(domain, expected, fold.written_at, relayed[1], actual)
    check.details.setdefault("compared_up_to", {})[domain] = relayed[0]
    check.found(findings)
    return findings


async def _caught_up(
    reader: asyncpg.Connection, names: list[str], domain: str, head: int, wait: float
) -> dict[str, tuple[int, int]]:
    """The followers' checkpoints for `domain`, once every one has reached version `head`, or
    as they are after `wait` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        applied = await db.follower_checkpoints(reader, names, domain)
        if all(applied.get(n, (0, 0))[0] >= head for n in names) or loop.time() >= deadline:
            return applied
        await asyncio.sleep(_POLL_S)


def _behind(check: str, domain: str, part: str, version: int, head: int, wait: float) -> Finding:
    return Finding(
        check=check,
        domain=domain,
        message=f"{part} is behind the log: at version {version} of {head} after waiting "
        f"{wait:g} s (a stalled follower; the engine's /healthz names it too)",
        details={"version": version, "head": head},
    )


async def _stream(
    reader: asyncpg.Connection,
    js: Any,
    prefix: str,
    domain: str,
    end: DomainEnd,
    relayed: int,
    head: int,
    checks: dict[str, _Check],
) -> list[Finding]:
    """Every message of `domain` in the stream, up to where it ended before the log was read,
    against the log (stream_audit), and how far it goes against the relay's checkpoint."""
    check = checks["stream"]
    audited = await stream_audit.audit(js, reader, prefix, domain, end.seq)
    now = ((await db.stream_head(reader, domain)) or (0, 0, ""))[0]
    findings = audited.findings(
        await stream_audit.log_events(reader, domain, set(audited.unexplained())), now
    )
    details = check.details
    details["events"] = details.get("events", 0) + audited.events
    details["foreign"] = details.get("foreign", 0) + len(audited.foreign)
    if audited.rewritten:
        rewritten = details.setdefault("rewritten", {})
        rewritten[domain] = [{"seq": s, "version": v} for s, v in audited.rewritten]
    if audited.events == 0:
        if relayed or head:
            findings.append(
                Finding(
                    check="stream",
                    domain=domain,
                    message=f"the stream holds no event of the domain; the relay says it "
                    f"published up to version {relayed} and the log is at {head}",
                )
            )
    elif (carried := audited.carried) < max(relayed, head):
        findings.append(
            Finding(
                check="stream",
                domain=domain,
                message=f"the stream carries the log's own events only up to version "
                f"{carried}; the log is at {head} and the relay says it published up to "
                f"{relayed}",
                details={"version": carried, "head": head, "relayed": relayed},
            )
        )
    check.found(findings)
    return findings


def _verifier_keys(args: argparse.Namespace, settings: Settings) -> tuple[list[Verifier], str]:
    """The keys to check the stored notes with and where they came from: every --key and
    --key-file, else the `.pub` file beside this data dir's signing key; else none and where
    none was found.

    Raises:
        CannotRun: a key given, or the one found, cannot be read or is no verifier key.
    """
    given = [("--key", text) for text in getattr(args, "key", None) or []]
    paths = [(f"--key-file {path}", path) for path in getattr(args, "key_file", None) or []]
    if not given and not paths:
        path = public_key_path(checkpoint_key_path(settings))
        if not path.is_file():
            return [], f"no --key or --key-file, no {path}"
        paths = [(str(path), path)]
    for where, path in paths:
        try:
            given.append((where, path.read_text()))
        except OSError as exc:
            raise CannotRun(f"cannot read the verifier key {path}: {exc.strerror or exc}") from None
    keys = []
    for where, text in given:
        try:
            keys.append(Verifier.parse(text))
        except NoteError as exc:
            # Several --key may be given: name the one that is wrong.
            named = f"--key {text!r}" if where == "--key" else where
            raise CannotRun(f"{named} holds no verifier key: {exc}") from None
    return keys, ", ".join(dict.fromkeys(where for where, _ in given))


async def _engine_key(
    nc: Any, why_not: str, prefix: str, domain: str
) -> tuple[Verifier | None, str]:
    """The verifier key the engine serving `domain` answers on `nc`, and that it did; or None
    and why not (`why_not`: why there is no connection)."""
    if nc is None:
        return None, f"cannot ask the engine for it ({why_not})"
    asked = f"the engine's checkpoint-key query ({domain})"
    try:
        reply = await TrellisClient(nc, prefix=prefix, timeout=NATS_TIMEOUT_S).query(
            domain, "checkpoint-key"
        )
    except nats.errors.NoRespondersError:
        return None, f"no engine answers {asked}"
    except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as exc:
        return None, f"{asked} failed: {str(exc) or type(exc).__name__}"
    if not reply.get("ok"):
        return None, f"{asked} was refused: {reply.get('error')}"
    try:
        return Verifier.parse(str(reply["result"]["verifier_key"])), asked
    except (NoteError, KeyError, TypeError) as exc:
        return None, f"{asked} answered no verifier key: {exc}"


async def _jetstream(url: str | None, credentials: NkeyCredentials | None) -> tuple[Any, Any, str]:
    """(JetStream context, connection, "") or (None, None, why not)."""
    if url is None:
        return None, None, "no NATS: TRELLIS_NATS_URL is unset and no `trellis up` runs here"
    import nats

    options = credentials.connect_options() if credentials is not None else {}
    try:
        # Bounded from outside: nats-py retries a first connect that is refused.
        nc = await asyncio.wait_for(
            nats.connect(
                nats_servers(url),
                name="trellis-verify",
                connect_timeout=NATS_TIMEOUT_S,
                allow_reconnect=False,
                error_cb=_quiet,
                **options,
            ),
            NATS_TIMEOUT_S,
        )
    except TimeoutError:
        return None, None, f"NATS unreachable at {url}: no connection in {NATS_TIMEOUT_S:g} s"
    except Exception as exc:
        return None, None, f"NATS unreachable at {url}: {str(exc) or type(exc).__name__}"
    return nc.jetstream(timeout=NATS_TIMEOUT_S), nc, ""


async def _quiet(exc: Exception) -> None:
    """nats-py's default prints each failed connect attempt; the report says it once."""


def _credentials(settings: Settings, creds: Path | None) -> NkeyCredentials | None:
    """--creds, else the auditor's identity where the data dir holds secure mode's, else none."""
    if creds is not None:
        return NkeyCredentials(creds)
    secure = SecureDir(settings.data_dir or default_data_dir())
    if secure.exists() and secure.seed_path(Principal("auditor", "auditor")).is_file():
        return secure.credentials(Principal("auditor", "auditor"))
    return None


# ---- text ----


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _stream_said(check: dict[str, Any]) -> str:
    said = [_count(check["events"], "event")]
    if check["foreign"]:
        said.append(f"{_count(check['foreign'], 'foreign message')} skipped")
    for domain, seen in check.get("rewritten", {}).items():
        at = ", ".join(f"seq {s['seq']} version {s['version']}" for s in seen[:5])
        more = f" and {len(seen) - 5} more" if len(seen) > 5 else ""
        said.append(
            f"{domain}: {_count(len(seen), 'event')} the log wrote again after a lost tail "
            f"({at}{more}): "
            "a failover's, or forged ones where anyone may publish into the stream"
        )
    return "; ".join(said)


def text(report: dict[str, Any]) -> str:
    """The report for people: each domain's anchor (chain head, latest checkpoint), its
    findings, then one line per check."""
    lines = []
    for domain, d in report["domains"].items():
        head = d["head"]
        lines.append(
            f"{domain}: head version {head['version']} position {head['position']} "
            f"hash {head['hash']}"
        )
        cp = d["latest_checkpoint"]
        if cp is None:
            lines.append("  latest checkpoint: none")
        else:
            lines.append(
                f"  latest checkpoint: size {cp['size']} root {cp['root']} at {cp['recorded_at']}"
            )
        for f in d["findings"]:
            lines.append(f"  FINDING {f['check']}: {f['message']}")
    for name, check in report["checks"].items():
        reason = f" ({check['reason']})" if check.get("reason") else ""
        if name == "chain":
            reason = f" ({check['events']} events)"
        if name == "stream" and "events" in check:
            reason = reason or f" ({_stream_said(check)})"
        if name == "notes":
            if not check["notes"] and check["status"] != "fail":
                continue  # no checkpoint stored: nothing to say
            if "keys" in check:
                signers = ", ".join("+".join(key.split("+")[:2]) for key in check["keys"])
                noted = f"{check['notes']} note{'' if check['notes'] == 1 else 's'}"
                noun = "key" if len(check["keys"]) == 1 else "keys"
                reason = f" ({noted}, {noun} {signers} from {check['key_from']})"
        lines.append(f"check {name}: {check['status']}{reason}")
    count = sum(len(d["findings"]) for d in report["domains"].values())
    lines.append(
        "verified: no findings"
        if report["ok"]
        else f"NOT verified: {count} finding{'' if count == 1 else 's'}"
    )
    return "\n".join(lines)
