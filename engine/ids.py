"""Identifier types shared by intents and events.

IDs appear as NATS subject tokens and KV keys, so the contract restricts them to a safe alphabet.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_ID_RE = re.compile(ID_PATTERN)

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
# Request ids are opaque client tokens (often uuids); they never become subject tokens.
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Labels = dict[Label, Annotated[str, msgspec.Meta(max_length=256)]]
Text = Annotated[str, msgspec.Meta(max_length=2048)]


def is_valid_id(value: str) -> bool:
    """True when `value` may be used as a domain, tenant, node or composition id."""
    return bool(_ID_RE.match(value))
