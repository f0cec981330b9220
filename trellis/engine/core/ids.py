"""Identifier types shared by intents and events.

IDs appear as NATS subject tokens and KV keys, so the contract restricts them to a safe alphabet.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

# The whole string, in both regex dialects that read these patterns: msgspec uses Python's
# `re.search`, where a bare `$` also matches before a final newline ("h01\n" would pass), and the
# JSON Schema export carries them to ECMA-262, which has no `\Z`. `(?!\n)$` means "the end, and
# no newline there" in both.
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}(?!\n)$"
_ID_RE = re.compile(ID_PATTERN)

# No control characters in free text: PostgreSQL text and jsonb cannot hold NUL, and a value
# the log cannot store must be refused at the door (`invalid`), not fail a whole batch later.
PLAIN_TEXT = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
# What an operator may point at: a node or link id, or `<ocs id>:<port>` for one port of an OCS.
# A port is written without leading zeros, so each port has exactly one spelling.
COMPONENT_REF_PATTERN = r"^[A-Za-z0-9_-]{1,64}(:(0|[1-9][0-9]{0,4}))?(?!\n)$"
ComponentRef = Annotated[str, msgspec.Meta(pattern=COMPONENT_REF_PATTERN)]
# Request ids are opaque client tokens (often uuids); they never become subject tokens.
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=PLAIN_TEXT)]
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=PLAIN_TEXT)]
MAX_LABELS = 64
Labels = Annotated[
    dict[Label, Annotated[str, msgspec.Meta(max_length=256, pattern=PLAIN_TEXT)]],
    msgspec.Meta(max_length=MAX_LABELS),
]
Text = Annotated[str, msgspec.Meta(max_length=2048, pattern=PLAIN_TEXT)]


def is_valid_id(value: str) -> bool:
    """True when `value` may be used as a domain, tenant, node or composition id."""
    return _ID_RE.fullmatch(value) is not None


def split_ref(ref: str) -> tuple[str, int | None]:
    """Split a ComponentRef: `"ocs-1:3"` -> `("ocs-1", 3)`, a plain id -> `(id, None)`."""
    node, colon, port = ref.partition(":")
    return (node, int(port)) if colon else (ref, None)
