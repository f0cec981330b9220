"""The KV side of `trellis verify`: what the bucket TRELLIS_STATE holds for a domain, and how
that compares with the values the log's fold says it should hold.

The keys come from the bucket's stream (`stream_info` with a subject filter, answered from
what is stored), not from nats-py's `keys()`, which watches and may stop early; each key's last
message is read with a plain message get (what the auditor identity may do), and a key whose
last message is a delete or purge marker is gone.

A value carries the log position of the event that wrote it (adapters/nats/kv_state.py). The
relay writes a key when an event changes it, and writes every key of a domain again, with the
position it has reached, when it (re)fills the bucket. So the position a value may carry is
not one number: it is at least the position of the last event that changed the key and at
most the position the relay had reached. Everything else in a value must equal the fold's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from trellis.adapters.nats.jetstream import bucket_name
from trellis.engine.core.audit import Finding

_IN_FLIGHT = 256
_GONE = ("DEL", "PURGE")


async def bucket_entries(js: JetStreamContext, prefix: str, domain: str) -> dict[str, bytes]:
    """Every live key of `domain` in the bucket for `prefix`, with its value.

    Raises:
        nats.js.errors.NotFoundError: the bucket does not exist.
    """
    bucket = bucket_name(prefix)
    stream = f"KV_{bucket}"
    head = f"$KV.{bucket}."
    info = await js.stream_info(stream, subjects_filter=f"{head}{domain}.>")
    subjects = list(info.state.subjects or {})
    values: dict[str, bytes] = {}

    async def last(subject: str) -> None:
        try:
            msg = await js.get_last_msg(stream, subject)
        except NotFoundError:
            return  # purged between the listing and the get
        if (msg.headers or {}).get("KV-Operation") in _GONE:
            return
        values[subject[len(head) :]] = msg.data or b""

    for start in range(0, len(subjects), _IN_FLIGHT):
        await asyncio.gather(*(last(s) for s in subjects[start : start + _IN_FLIGHT]))
    return values


def compare(
    domain: str,
    expected: dict[str, bytes],
    written_at: dict[str, int],
    reached: int,
    actual: dict[str, bytes],
    limit: int = 50,
) -> list[Finding]:
    """Findings where the bucket (`actual`) is not what the fold says (`expected`, rendered
    with any position): a missing or extra key, a field that differs, or a position before
    the key's last change (`written_at`) or beyond what the relay had reached (`reached`)."""
    findings: list[Finding] = []
    decode = msgspec.json.Decoder().decode
    for key in sorted(expected.keys() | actual.keys()):
        if len(findings) >= limit:
            findings.append(
                Finding(check="kv", domain=domain, message="more KV differences not listed")
            )
            break
        if key not in actual:
            findings.append(_kv(domain, key, f"KV key {key} is missing from the bucket"))
            continue
        if key not in expected:
            findings.append(_kv(domain, key, f"KV key {key} is in the bucket but not in the log"))
            continue
        try:
            have: dict[str, Any] = decode(actual[key])
        except msgspec.DecodeError:
            findings.append(_kv(domain, key, f"KV key {key} holds no JSON object"))
            continue
        want: dict[str, Any] = decode(expected[key])
        position = have.pop("position", None)
        want.pop("position", None)
        fields = sorted(f for f in want.keys() | have.keys() if want.get(f) != have.get(f))
        if fields:
            findings.append(
                _kv(
                    domain,
                    key,
                    f"KV key {key} differs from the log in {', '.join(fields)}",
                    columns=fields,
                    bucket={f: have.get(f) for f in fields},
                    log={f: want.get(f) for f in fields},
                )
            )
        low = written_at.get(key, 0)
        if not isinstance(position, int) or not low <= position <= reached:
            findings.append(
                _kv(
                    domain,
                    key,
                    f"KV key {key} says position {position}; the event that last changed it is "
                    f"at {low} and the relay had reached {reached}",
                    position=position,
                    written_at=low,
                    reached=reached,
                )
            )
    return findings


def _kv(domain: str, key: str, message: str, **details: Any) -> Finding:
    return Finding(check="kv", domain=domain, key=key, message=message, details=details)
