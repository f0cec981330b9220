"""Which reply subjects the engine answers on (ARCHITECTURE §3): an inbox one requester can
subscribe to alone. The integration tests (tests/integration/test_reply_subjects.py) show the
engine dropping the others unanswered; these name the subjects each rule admits."""

from __future__ import annotations

import pytest

from trellis.adapters.nats.replies import AnyInbox, OwnInbox, is_inbox

ACME = "_INBOX.UACME"


@pytest.mark.parametrize("reply", ["_INBOX.x", "_INBOX.a.b", "_INBOX.Zx9_-.42"])
def test_an_inbox_is_the_prefix_and_whole_tokens(reply: str) -> None:
    assert is_inbox(reply) and AnyInbox().allows("intent", "acme", reply)


@pytest.mark.parametrize(
    "reply",
    ["_INBOX", "_INBOX.", "_INBOX..x", "_INBOX.a..b", "_INBOX.a.", "_INBOX.>", "_INBOX.*",
     "_INBOX.a.>", "_INBOX.a*", "_INBOX.a b", "_INBOX.a\tb", "_INBOX.a\r\nPUB x 1", "x._INBOX.a"],
)  # fmt: skip
def test_what_reaches_nobody_or_everybody_is_no_inbox(reply: str) -> None:
    assert not is_inbox(reply) and not AnyInbox().allows("intent", "acme", reply)


@pytest.mark.parametrize(
    ("reply", "allowed"),
    [(f"{ACME}.x", True), (f"{ACME}.x.y", True), (f"{ACME}.", False), (f"{ACME}..x", False),
     (f"{ACME}.>", False), (f"{ACME}.*", False), (ACME, False), ("_INBOX.UGLOBEX.x", False)],
)  # fmt: skip
def test_in_secure_mode_only_whole_subjects_of_the_tenants_own_inbox(
    reply: str, allowed: bool
) -> None:
    rule = OwnInbox(
        lambda: ("_INBOX.UOP", "_INBOX.UAUD", {"acme": ACME, "globex": "_INBOX.UGLOBEX"})
    )
    assert rule.allows("intent", "acme", reply) is allowed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tenants_key_replaced_while_the_engine_runs_is_read_again_at_most_once_a_second() -> None:
    """`trellis tenant add` after the tenant's .nk was removed issues it a new key: its inbox
    changes under the same name, and the old one stays refused."""
    issued = {"acme": ACME}
    reads = []

    def inboxes() -> tuple[str, str, dict[str, str]]:
        reads.append(dict(issued))
        return "_INBOX.UOP", "_INBOX.UAUD", dict(issued)

    clock = Clock()
    rule = OwnInbox(inboxes, clock)
    assert rule.allows("intent", "acme", f"{ACME}.x")
    issued["acme"] = "_INBOX.UACMENEW"
    assert rule.allows("intent", "acme", "_INBOX.UACMENEW.x")  # read again at once
    assert not rule.allows("intent", "acme", f"{ACME}.x")  # the old key's inbox
    assert len(reads) == 2
    for _ in range(100):  # mismatches within the second read nothing more
        assert not rule.allows("intent", "acme", "_INBOX.UELSE.x")
    assert len(reads) == 2
    clock.now += 1.0
    assert not rule.allows("intent", "acme", "_INBOX.UELSE.x")
    assert len(reads) == 3
