"""`trellis checkpoint`, `proof`, `consistency`, `checkpoint-key`, and the offline check of a
proof: `trellis verify --checkpoint FILE --proof FILE`.

The offline check needs no server, no database and no trust in the operator: only the
checkpoint notes the auditor kept, a proof file (the result of the `proof` or `consistency`
query, as `trellis proof` / `trellis consistency` print it) and the verifier key (the
`checkpoint-key` query's answer, or `<data dir>/checkpoint-key.pem.pub`, obtained once and
kept apart; after a key rotation, the old and the new). It checks each note's Ed25519
signature with one of the keys, that the proof's tree
size and root are a signed checkpoint's, and the proof itself per RFC 9162
(engine/core/merkle.py). An inclusion proof is of an event hash: given with `--event-hash`, or
recomputed from the event itself (`--event FILE`: the event as the TRELLIS_EVENTS stream
carries it, or a row of `trellis export --parquet`'s events as DuckDB or pyarrow write it in
JSON), which also checks that the event is the one at that leaf.

The commands that talk to the engine get the CLI's request function from
adapters/entrypoints/cli/parser.py, which registers them.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import sys
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from trellis.adapters.entrypoints import render
from trellis.adapters.entrypoints.cli.errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
)
from trellis.adapters.nats.jetstream import Envelope
from trellis.engine.core.checkpoints import Checkpoint, NoteError, Verifier, open_checkpoint_by_any
from trellis.engine.core.merkle import HASH_SIZE, leaf_hash, verify_consistency, verify_inclusion
from trellis.engine.core.records import format_time

Request = Callable[[argparse.Namespace, str, dict[str, Any]], dict[str, Any]]
CommittedNote = Callable[[argparse.Namespace, dict[str, Any], str], None]


class ProofRejected(Exception):
    """The proof, a checkpoint or the key does not hold up; the message says what."""


_HELP_HINT = "`trellis verify --help`"
_EVENT_HINT = (
    "give the event as the TRELLIS_EVENTS stream carries it, or an export's row in JSON "
    "(docs/auditing.md)"
)


class FileUnreadable(Exception):
    """A file the command line names cannot be read, or holds nothing of what it should (the
    proof not JSON, the event in neither form): nothing was checked, the file is to change."""

    def __init__(self, message: str, hint: str = _HELP_HINT):
        super().__init__(message)
        self.hint = hint


class ExportRow(msgspec.Struct):
    """A row of an export's events (adapters/postgres/export.py EVENTS) in JSON, as DuckDB's
    `COPY ... TO 'row.json'` or `json.dumps(row, default=str)` of a pyarrow row writes it:
    `time` is the `recorded_at` (any ISO 8601 time with an offset), `data` the stored JSON
    text as a string. Other columns (the hive partitions' `day`) are ignored."""

    id: str
    domain: str
    version: int
    position: int
    type: str
    schema_version: int
    time: str
    actor: str
    causation: str
    correlation: str
    prev_hash: str
    hash: str
    data: str


# ---- the offline check ----


def event_hash_bytes(text: str) -> bytes:
    """The 32 bytes of an event hash given as 64 hex digits, as the log and the stream carry
    it (no `sha256:` prefix: a hash so written is refused, not guessed at).

    Raises:
        ValueError: it is not 64 hex digits; the message says so.
    """
    try:
        digest = bytes.fromhex(text)
    except ValueError:
        digest = b""
    if len(digest) != HASH_SIZE or len(text) != 2 * HASH_SIZE:
        raise ValueError(
            f"the event hash {text[:80]!r} is not {2 * HASH_SIZE} hex digits (write it as the "
            "log and the stream carry it, without a prefix such as sha256:)"
        )
    return digest


def check(
    notes: list[str],
    proof: dict[str, Any],
    verifier_keys: str | Sequence[str],
    *,
    event_hash: str | None = None,
) -> str:
    """Check `proof` against the signed checkpoints `notes` with `verifier_keys` alone (one
    key, or several: after a key rotation older notes are the old key's); the line that says
    what was proved. Each note must verify with one of the keys.

    Raises:
        ProofRejected: anything does not hold.
    """
    if event_hash is not None:
        try:
            event_hash_bytes(event_hash)
        except ValueError as exc:  # the caller's argument, not the proof file, is bad
            raise ProofRejected(str(exc)) from None
    keys = [verifier_keys] if isinstance(verifier_keys, str) else verifier_keys
    try:
        verifiers = [Verifier.parse(key) for key in keys]
        opened = [open_checkpoint_by_any(note, verifiers) for note in notes]
    except NoteError as exc:
        raise ProofRejected(str(exc)) from None
    if not opened:
        raise ProofRejected("give at least one checkpoint (--checkpoint FILE)")
    signers = {checkpoint: verifier.key_id for checkpoint, verifier in opened}
    origins = {c.origin for c in signers}
    if len(origins) > 1:
        raise ProofRejected(f"the checkpoints are of different logs: {', '.join(sorted(origins))}")
    try:
        if "leaf_index" in proof:
            return _inclusion(signers, proof, event_hash)
        if "from_size" in proof:
            return _consistency(signers, proof)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ProofRejected(f"the proof file is malformed: {exc!r}") from None
    raise ProofRejected("the proof file holds neither an inclusion nor a consistency proof")


def _inclusion(
    signers: dict[Checkpoint, str], proof: dict[str, Any], event_hash: str | None
) -> str:
    """`signers`: each signed checkpoint given, and the key id it verified with."""
    if event_hash is None:
        raise ProofRejected("an inclusion proof is of an event: give --event-hash or --event")
    index, size = int(proof["leaf_index"]), int(proof["tree_size"])
    signed = _signed_at(list(signers), size)
    if _decode(proof["root"]) != signed.root:
        raise ProofRejected(f"the proof's root is not the signed root of size {size}")
    leaf = leaf_hash(event_hash_bytes(event_hash))
    if not verify_inclusion(leaf, index, size, [_decode(p) for p in proof["path"]], signed.root):
        raise ProofRejected(
            f"the proof does not put event hash {event_hash} at leaf {index} of {signed.origin}'s "
            f"tree of {size} events"
        )
    return (
        f"ok: event hash {event_hash[:16]}… is leaf {index} (version {index + 1}) of "
        f"{signed.origin}'s tree of {size} events, signed by {signers[signed]}"
    )


def _consistency(signers: dict[Checkpoint, str], proof: dict[str, Any]) -> str:
    """`signers`: as for `_inclusion`."""
    checkpoints = list(signers)
    old, new = int(proof["from_size"]), int(proof["to_size"])
    roots = {old: _decode(proof["from_root"]), new: _decode(proof["to_root"])}
    for checkpoint in checkpoints:
        if checkpoint.size not in roots:
            raise ProofRejected(
                f"the checkpoint of size {checkpoint.size} is neither end of the proof "
                f"({old} -> {new})"
            )
        if roots[checkpoint.size] != checkpoint.root:
            raise ProofRejected(f"the proof's root of size {checkpoint.size} is not the signed one")
    path = [_decode(p) for p in proof["path"]]
    if not verify_consistency(old, new, roots[old], roots[new], path):
        raise ProofRejected(f"the proof does not show the tree of {old} is a prefix of {new}'s")
    anchored = " and ".join(str(s) for s in sorted({c.size for c in checkpoints}))
    by = " and ".join(sorted(set(signers.values())))
    return (
        f"ok: {checkpoints[0].origin}'s log of {old} events is a prefix of its log of {new} "
        f"(signed checkpoints of {anchored} by {by})"
    )


def _signed_at(checkpoints: list[Checkpoint], size: int) -> Checkpoint:
    for checkpoint in checkpoints:
        if checkpoint.size == size:
            return checkpoint
    sizes = ", ".join(str(c.size) for c in checkpoints)
    raise ProofRejected(f"the proof is for a tree of {size} events; the checkpoints are of {sizes}")


def _decode(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def event_file_hash(path: Path) -> tuple[str, int]:
    """The hash of the event in `path`, recomputed from its content, and its version. The
    file holds the event as the stream carries it or as an export's row (one JSON object,
    or an array of just one, as DuckDB's `COPY ... (ARRAY true)` writes it).

    Raises:
        FileUnreadable: no such file, or it holds no event in either form.
        ProofRejected: its content does not give its own hash.
    """
    envelope, at = _read_event(path)
    computed = envelope.computed_hash(at)
    if computed != envelope.hash:
        raise ProofRejected(f"the event in {path} does not hash to the hash it carries")
    return computed, envelope.version


def _read_event(path: Path) -> tuple[Envelope, datetime]:
    """The event in `path` as the stream's envelope, and its time."""
    try:
        text = path.read_bytes()
        if text.lstrip().startswith(b"["):
            items = msgspec.json.decode(text, type=list[msgspec.Raw])
            if len(items) != 1:
                raise FileUnreadable(
                    f"{path} holds {len(items)} events in an array; give the one proved",
                    _EVENT_HINT,
                )
            text = bytes(items[0])
        fields = msgspec.json.decode(text, type=dict[str, msgspec.Raw])
        if "recorded_at" in fields:
            envelope = msgspec.json.decode(text, type=Envelope)
            return envelope, _instant(envelope.recorded_at)
        if "time" not in fields:
            raise FileUnreadable(
                f"{path} holds neither the stream's form of an event (it has no recorded_at) "
                "nor an export's row (it has no time)",
                _EVENT_HINT,
            )
        row = msgspec.json.decode(text, type=ExportRow)
        at = _instant(row.time)
    except OSError as exc:
        raise FileUnreadable(f"cannot read {path}: {exc.strerror}", _EVENT_HINT) from None
    except (msgspec.DecodeError, ValueError) as exc:
        raise FileUnreadable(f"cannot read the event in {path}: {exc}", _EVENT_HINT) from None
    envelope = Envelope(
        id=row.id,
        domain=row.domain,
        version=row.version,
        position=row.position,
        type=row.type,
        schema_version=row.schema_version,
        recorded_at=format_time(at),
        actor=row.actor,
        causation_id=row.causation,
        correlation_id=row.correlation,
        data=msgspec.Raw(row.data.encode()),
        prev_hash=row.prev_hash,
        hash=row.hash,
    )
    return envelope, at


def _instant(text: str) -> datetime:
    """An ISO 8601 time with an offset (`Z`, `+00`, `+01:00`...): the hash covers the instant
    in UTC (records.format_time), so any offset of the same instant gives the same hash."""
    at = datetime.fromisoformat(text)
    if at.tzinfo is None:
        raise ValueError(f"the time {text!r} has no offset (Z, +00:00...): which instant is it?")
    return at


# ---- the commands ----


def register(
    sub: Any,
    request: Request,
    committed_note: CommittedNote,
    client_options: Callable[[Any], None],
    request_id_option: Callable[[Any], None],
) -> None:
    """Add checkpoint, proof, consistency and checkpoint-key to the `trellis` parser."""
    cp = sub.add_parser("checkpoint", help="sign and publish a checkpoint of the log now")
    request_id_option(cp)  # an admin request: resent with its id, it is answered from the log
    client_options(cp)
    cp.set_defaults(run=lambda args: _checkpoint(args, request, committed_note))

    proof = sub.add_parser("proof", help="an RFC 9162 inclusion proof of an event (JSON)")
    proof.add_argument(
        "event_id", help="the event's id (a UUID; `trellis watch -o json` shows each event's)"
    )
    proof.add_argument("--size", type=int, help="tree size (default: the latest checkpoint's)")
    proof.add_argument("--view", metavar="TENANT", help="ask as TENANT's view")
    client_options(proof)
    proof.set_defaults(run=lambda args: _proof(args, request))

    cons = sub.add_parser("consistency", help="an RFC 9162 consistency proof (JSON)")
    cons.add_argument("from_size", type=int, help="the older tree size (a checkpoint's)")
    cons.add_argument("to_size", type=int, help="the newer tree size")
    cons.add_argument("--view", metavar="TENANT", help="ask as TENANT's view")
    client_options(cons)
    cons.set_defaults(run=lambda args: _consistency_command(args, request))

    key = sub.add_parser("checkpoint-key", help="the verifier key of the checkpoint signer")
    client_options(key)
    key.set_defaults(run=lambda args: _checkpoint_key(args, request))


def add_offline_verify(p: argparse.ArgumentParser) -> None:
    """The offline proof check's options on `trellis verify` (which also verifies the log
    against the database when given no --proof; that mode lives elsewhere)."""
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a signed checkpoint note (repeatable: both ends of a consistency proof)",
    )
    p.add_argument("--proof", type=Path, metavar="FILE", help="a proof or consistency file")
    # Repeatable, and the two may be mixed: every key given is used (after a key rotation the
    # old and the new), so none is ignored.
    p.add_argument(
        "--key",
        action="append",
        metavar="VERIFIER_KEY",
        help="the checkpoint signer's verifier key (repeatable: after a key rotation, give the "
        "old and the new)",
    )
    p.add_argument(
        "--key-file",
        action="append",
        type=Path,
        metavar="FILE",
        help="a file holding a verifier key (repeatable, as --key)",
    )
    p.add_argument(
        "--event-hash",
        type=_event_hash_argument,
        metavar="HEX",
        help="the hash of the event proved included (64 hex digits, no sha256: prefix)",
    )
    p.add_argument(
        "--event",
        type=Path,
        metavar="FILE",
        help="the event itself: as the stream carries it, or an export's row, in JSON",
    )


def _event_hash_argument(text: str) -> str:
    try:
        event_hash_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def verify_offline(args: argparse.Namespace) -> int:
    """`trellis verify --checkpoint FILE --proof FILE`: exit 0 and one `ok:` line when the
    proof holds, else 1 and one line saying what does not.

    Raises:
        CliError: the command line lacks a checkpoint, the proof or the key (exit 2, a usage
            line).
    """
    missing = [
        what
        for what, given in (
            ("a signed checkpoint (--checkpoint FILE)", args.checkpoint),
            ("the proof (--proof FILE)", args.proof is not None),
            ("the verifier key (--key KEY or --key-file FILE)", args.key or args.key_file),
        )
        if not given
    ]
    if missing:
        raise CliError(
            f"an offline check needs {' and '.join(missing)}",
            code="usage",
            hint="`trellis verify --help`",
            exit=EXIT_USAGE,
        )
    try:
        keys = _keys(args)
        notes = [_note_file(path) for path in args.checkpoint]
        try:
            proof = msgspec.json.decode(_read(args.proof).encode())
        except msgspec.DecodeError as exc:
            raise FileUnreadable(f"{args.proof} is not JSON: {exc}") from None
        if isinstance(proof, dict) and isinstance(proof.get("result"), dict):
            proof = proof["result"]  # a whole reply (as `nats req` prints it) will do too
        if not isinstance(proof, dict):
            raise ProofRejected(f"{args.proof} holds no proof object")
        event_hash = args.event_hash
        if "leaf_index" in proof and event_hash is None and args.event is None:
            # The command line lacks the event: nothing was checked (exit 1 is a proof that
            # does not hold).
            raise FileUnreadable(
                "an inclusion proof is of an event: give --event FILE or --event-hash HASH",
                _EVENT_HINT,
            )
        if args.event is not None:
            event_hash, version = event_file_hash(args.event)
            if "leaf_index" in proof and int(proof["leaf_index"]) != version - 1:
                raise ProofRejected(
                    f"the event is version {version}; the proof is of leaf {proof['leaf_index']}"
                )
        print(check(notes, proof, keys, event_hash=event_hash))
        return 0
    except FileUnreadable as exc:  # nothing was checked: the file given is to change
        raise CliError(str(exc), code="usage", hint=exc.hint, exit=EXIT_USAGE) from None
    except ProofRejected as exc:
        print(f"trellis verify: FAILED: {exc}", file=sys.stderr)
        return 1


def _keys(args: argparse.Namespace) -> list[str]:
    """The verifier keys given, each one a key (else nothing is checked: a key that is no key
    is the command line's mistake, as a malformed --event-hash is)."""
    keys = [*(args.key or []), *(_read(path).strip() for path in args.key_file or [])]
    for key in keys:
        try:
            Verifier.parse(key)
        except NoteError as exc:
            raise FileUnreadable(f"{key!r} is no verifier key: {exc}") from None
    return keys


def _note_file(path: Path) -> str:
    """A note as kept in a file: trailing blank lines (an editor's, or `psql -At`'s) are no
    part of it. A C2SP note ends with its last signature line, and Verifier.open holds to that;
    a file may say more."""
    return _read(path).rstrip("\n") + "\n"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise FileUnreadable(f"cannot read {path}: {exc}") from None


def _checkpoint(args: argparse.Namespace, request: Request, committed_note: CommittedNote) -> int:
    rid = args.request_id or str(uuid.uuid4())
    reply = request(args, f"admin.{args.domain}.checkpoint", {"request_id": rid})
    # The note as signed, its lines as they are (no tenant's text is in it).
    code = _print(args, reply, lambda result: result["note"].rstrip("\n"))
    committed_note(args, reply, rid)
    return code


def _proof(args: argparse.Namespace, request: Request) -> int:
    body: dict[str, Any] = {"event_id": args.event_id}
    if args.size is not None:
        body["size"] = args.size
    reply = request(args, _subject(args, "proof"), body)
    code = _print(args, reply, _pretty)
    result = reply.get("result") if reply.get("ok") else None
    if isinstance(result, dict) and result.get("checkpoint") is None:
        # The root is then only the log's word (the log's own checkpoint at that size may
        # even have been refused as not this deployment's): say what vouches for it.
        print(
            f"(no signed checkpoint of {result.get('tree_size')} events comes with this proof: "
            "its root is the log's as it is now; check it against a checkpoint note you kept, "
            "with `trellis verify --checkpoint NOTE --proof FILE --key-file KEY "
            "--event EVENT`)",
            file=sys.stderr,
        )
    return code


def _consistency_command(args: argparse.Namespace, request: Request) -> int:
    body = {"from_size": args.from_size, "to_size": args.to_size}
    reply = request(args, _subject(args, "consistency"), body)
    code = _print(args, reply, _pretty)
    if reply.get("ok"):
        # A consistency result carries no checkpoint (§6): both roots are the log's word, as
        # a proof's is without one; say what would vouch for them.
        print(
            "(both roots are the log's as it is now; check them against checkpoint notes you "
            "kept, with `trellis verify --checkpoint OLD --checkpoint NEW --proof FILE "
            "--key-file KEY`)",
            file=sys.stderr,
        )
    return code


def _checkpoint_key(args: argparse.Namespace, request: Request) -> int:
    reply = request(args, f"query.{args.domain}.checkpoint-key", {})
    return _print(args, reply, lambda result: result["verifier_key"])


def _subject(args: argparse.Namespace, what: str) -> str:
    if getattr(args, "view", None):
        return f"view.{args.domain}.{args.view}.{what}"
    return f"query.{args.domain}.{what}"


def _pretty(result: dict[str, Any]) -> str:
    return msgspec.json.format(msgspec.json.encode(result), indent=2).decode()


def _print(args: argparse.Namespace, reply: dict[str, Any], show: Callable[[Any], str]) -> int:
    if args.output == "json":
        print(_pretty(reply["result"] if reply.get("ok") else reply))
    elif reply.get("ok"):
        print(show(reply["result"]))
    else:
        print(render.error_text(render.visible(reply["error"])), file=sys.stderr)
    if reply.get("ok"):
        return EXIT_OK
    # As every command's (talk.print_reply): 3 for `unavailable`, which a retry may get past.
    return EXIT_UNAVAILABLE if reply["error"].get("code") == "unavailable" else EXIT_FAILED
