"""What keeps every message under NATS's limit (issue 21, finding 5), pure: an import recorded
in parts (engine/core/topology.py `in_parts`), folded as one; an import received in parts
(engine/core/uploads.py); answers cut into pages (engine/core/paging.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from trellis.engine.core.audit import InvariantAudit
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import TopologyImported, encode
from trellis.engine.core.intents import ImportTopology, Upload
from trellis.engine.core.model import LinkSpec, NodeSpec
from trellis.engine.core.paging import paged
from trellis.engine.core.results import FreeResult, UploadProgress
from trellis.engine.core.state import DomainState, evolve
from trellis.engine.core.topology import in_parts
from trellis.engine.core.uploads import ASSEMBLED_TTL_S, TTL_S, Uploads

AT = datetime(2026, 12, 1, tzinfo=UTC)


def hall(devices: int) -> tuple[list[NodeSpec], list[LinkSpec]]:
    nodes = [NodeSpec(id="h", kind="host"), NodeSpec(id="sw", kind="switch")]
    links = [LinkSpec(id="l-h", a="h", b="sw", capacity_gbps=256)]
    for i in range(devices):
        labels = {"rack": f"r{i % 7}", "note": "x" * 40}
        nodes.append(
            NodeSpec(id=f"g{i}", kind="device", device_kind="gpu", model="H100", labels=labels)
        )
        links.append(LinkSpec(id=f"l{i}", a="sw", b=f"g{i}", capacity_gbps=64))
    return nodes, links


def test_a_large_import_is_recorded_in_parts_that_each_fit_and_hold_it_all() -> None:
    nodes, links = hall(2000)
    ids = [n.id for n in nodes] + [lk.id for lk in links]
    whole = TopologyImported(
        nodes=nodes, links=links, added=ids[:3000], updated=ids[3000:3500], removed=["old"] * 9
    )
    budget = 40_000
    parts = in_parts(whole, budget)
    assert len(parts) > len(encode(whole)) // budget
    assert all(len(encode(p)) <= budget for p in parts)
    assert [(p.part, p.parts) for p in parts] == [(i + 1, len(parts)) for i in range(len(parts))]
    assert [n for p in parts for n in p.nodes] == nodes
    assert [lk for p in parts for lk in p.links] == links
    assert sorted(x for p in parts for x in p.added) == sorted(whole.added)
    assert sorted(x for p in parts for x in p.updated) == sorted(whole.updated)
    assert sum(len(p.removed) for p in parts) == 9
    assert in_parts(whole, 10**9) == [whole]  # small enough: one event, part 1 of 1


def test_parts_fold_into_exactly_the_state_and_audit_the_whole_event_gives() -> None:
    nodes, links = hall(500)
    before = evolve(DomainState(domain="d"), TopologyImported(nodes=nodes[:10], links=links[:3]))
    whole = TopologyImported(nodes=nodes, links=links)
    parts = in_parts(whole, 20_000)
    assert len(parts) > 2
    folded = before
    for i, part in enumerate(parts):
        folded = evolve(folded, part)
        if i < len(parts) - 1:  # until the last part, the topology is the one before
            assert (folded.nodes, folded.links) == (before.nodes, before.links)
    assert folded == evolve(before, whole)
    assert folded.staged is None

    audits = [InvariantAudit("d"), InvariantAudit("d")]
    for audit, events in zip(audits, ([whole], parts), strict=True):
        for version, event in enumerate(events, 1):
            data = msgspec.json.decode(encode(event))
            audit.feed(version, version, "TopologyImported", data)
    assert audits[0]._nodes == audits[1]._nodes and audits[0]._links == audits[1]._links


def upload(part: int, parts: int, nodes: list[NodeSpec], rid: str = "r1") -> ImportTopology:
    return ImportTopology(
        request_id=rid, nodes=nodes, reason="big", upload=Upload(part=part, parts=parts)
    )


def test_an_import_in_parts_is_whole_once_its_last_part_is_in_whatever_the_order() -> None:
    nodes, _ = hall(30)
    uploads = Uploads()
    got = [
        uploads.add("d", "operator", upload(3, 3, nodes[20:]), 0.0),
        uploads.add("d", "operator", upload(1, 3, nodes[:10]), 1.0),
        uploads.add("d", "operator", upload(1, 3, nodes[:10]), 1.5),  # a resend: replaced
    ]
    assert got == [
        UploadProgress(part=3, parts=3, received=1),
        UploadProgress(part=1, parts=3, received=2),
        UploadProgress(part=1, parts=3, received=2),
    ]
    whole = uploads.add("d", "operator", upload(2, 3, nodes[10:20]), 2.0)
    assert whole == ImportTopology(request_id="r1", nodes=nodes, reason="big")


def test_a_part_resent_after_its_upload_was_assembled_gets_the_import_not_a_new_upload() -> None:
    """A client resends a part it heard nothing for while the import was being decided (a
    65,536-device import takes seconds): the resend is the same import, so the writer answers
    it from its stored reply. As a new upload's first part it would be answered with progress,
    and the client would take that for the import's answer."""
    nodes, _ = hall(20)
    uploads = Uploads()
    uploads.add("d", "operator", upload(1, 2, nodes[:10]), 0.0)
    whole = uploads.add("d", "operator", upload(2, 2, nodes[10:]), 1.0)
    assert uploads.add("d", "operator", upload(2, 2, nodes[10:]), 3.0) == whole
    assert uploads.add("d", "operator", upload(1, 2, nodes[:10]), 4.0) == whole
    # Long after, the same request id starts an upload again (its answer is stored anyway).
    later = uploads.add("d", "operator", upload(1, 2, nodes[:10]), 1.0 + ASSEMBLED_TTL_S + 1)
    assert later == UploadProgress(part=1, parts=2, received=1)


def test_a_part_sent_again_with_another_body_after_the_assembly_is_conflict() -> None:
    """It got the first import's answer, `replayed`, as if it were a resend of the same part:
    the same request id with another body is `conflict` (ARCHITECTURE §3)."""
    nodes, _ = hall(20)
    uploads = Uploads()
    uploads.add("d", "operator", upload(1, 2, nodes[:10]), 0.0)
    uploads.add("d", "operator", upload(2, 2, nodes[10:]), 1.0)
    for part, other in [(1, nodes[:9]), (2, nodes[:10])]:
        with pytest.raises(IntentRejected) as refused:
            uploads.add("d", "operator", upload(part, 2, other), 2.0)
        assert refused.value.code == "conflict" and f"part {part} differs" in str(refused.value)


def test_a_part_that_does_not_fit_its_upload_is_invalid_and_old_uploads_are_forgotten() -> None:
    nodes, _ = hall(3)
    uploads = Uploads()
    uploads.add("d", "operator", upload(1, 3, nodes), 0.0)
    with pytest.raises(IntentRejected) as refused:
        uploads.add("d", "operator", upload(2, 4, nodes), 1.0)
    assert refused.value.code == "invalid" and "sent in 3" in str(refused.value)
    with pytest.raises(IntentRejected):
        uploads.add("d", "operator", upload(5, 4, nodes, rid="r2"), 1.0)
    # Past the time to live, the first part is gone: the upload starts again.
    assert uploads.add("d", "operator", upload(2, 3, nodes), TTL_S + 10) == UploadProgress(
        part=2, parts=3, received=1
    )


def test_pages_hold_every_item_once_in_order_and_each_fits() -> None:
    nodes, _ = hall(3000)
    devices = [msgspec.convert(msgspec.to_builtins(n), dict) for n in nodes[2:]]
    result = msgspec.convert({"devices": devices}, FreeResult)
    assert paged(result, 0, budget=10**9) is result  # fits: one page, no `next`
    pages, offset = [], 0
    while True:
        page = paged(result, offset, budget=50_000)
        assert len(encode(page)) <= 50_000
        pages.append(page)
        if page.next is msgspec.UNSET:
            break
        offset = page.next
    assert [d for p in pages for d in p.devices] == result.devices
    assert len(pages) > 3


class _Two(msgspec.Struct, kw_only=True):
    a: list[str]
    b: list[str]
    next: int | msgspec.UnsetType = msgspec.UNSET


def test_a_page_spans_the_lists_of_an_answer_in_their_order() -> None:
    answer = _Two(a=[f"a{i:03}" for i in range(100)], b=[f"b{i:03}" for i in range(100)])
    pages, offset = [], 0
    while True:
        page = paged(answer, offset, budget=300)
        pages.append(page)
        if page.next is msgspec.UNSET:
            break
        offset = page.next
    assert [x for p in pages for x in p.a] == answer.a
    assert [x for p in pages for x in p.b] == answer.b
    assert any(p.a and p.b for p in pages)  # one page ends a list and starts the next
