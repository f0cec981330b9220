"""Reservations (issue 23 item 3), decided purely: preview, reserve, apply, cancel, expire.

Given a small fabric, when a tenant reserves devices, then nobody else may compose, reserve or
see them as free until the reservation is applied, cancelled or expires; applying it composes
exactly those devices; every refusal of a malformed request writes nothing, and an ended
reservation is `conflict`, saying how it ended.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fabric_builder import (
    NOW,
    FabricBuilder,
    apply,
    compose,
    compose_pending,
    composed,
    release,
    report_fault,
    request_id,
    run,
)

from trellis.engine.core import queries, reservations, views
from trellis.engine.core.errors import IntentRejected
from trellis.engine.core.events import (
    CompositionRejected,
    CompositionRequested,
    DevicesReserved,
    QuotaSet,
    ReservationApplied,
    ReservationCancelled,
    ReservationExpired,
    ReservationMade,
)
from trellis.engine.core.intents import (
    RESERVATION_SECONDS,
    Apply,
    CancelReservation,
    EstablishComposition,
    ExpireReservations,
    ImportTopology,
    InvalidIntent,
    PreviewQuery,
    Remove,
    ReservationsQuery,
    Reserve,
    decode_intent,
    settle_request_id,
)
from trellis.engine.core.results import ComposeResult, ReservationResult
from trellis.engine.core.state import DomainState, Held
from trellis.engine.core.upcast import upcast

GPU: dict[str, Any] = {"kind": "gpu"}


def hall() -> DomainState:
    """h1 and h2 on one switch with three GPUs and a 1024 GiB memory pool."""
    b = FabricBuilder().host("h1").host("h2").switch("sw")
    b.gpu("g1").gpu("g2").gpu("g3").memory("m1", 1024)
    for node in ("h1", "h2", "g1", "g2", "g3", "m1"):
        b.link(node, "sw")
    return b.state()


def reserve(
    state: DomainState, tenant: str, *, now: Any = NOW, duration: int | None = None, **manifest: Any
) -> tuple[list[Any], Any]:
    body: dict[str, Any] = {"request_id": request_id(), "manifest": manifest}
    if duration is not None:
        body["duration_seconds"] = duration
    return run(state, msgspec.convert(body, Reserve), tenant, now)


def reserved(state: DomainState, tenant: str, **manifest: Any) -> tuple[DomainState, Any]:
    """Reserve that must succeed: the state after it and the ReservationResult."""
    events, result = reserve(state, tenant, **manifest)
    assert isinstance(result, ReservationResult), f"{result.code}: {result.message}"
    return apply(state, events), result


def apply_reservation(
    state: DomainState, tenant: str, rid: str, *, now: Any = NOW
) -> tuple[list[Any], Any]:
    return run(state, Apply(request_id=request_id(), reservation_id=rid), tenant, now)


def cancel(state: DomainState, tenant: str, rid: str, *, now: Any = NOW) -> tuple[list[Any], Any]:
    return run(state, CancelReservation(request_id=request_id(), reservation_id=rid), tenant, now)


def free_ids(state: DomainState) -> list[str]:
    return [d.id for d in queries.free(state, None).devices]


# ---- reserve ----


def test_reserve_records_what_a_compose_would_take_and_holds_it_for_its_duration() -> None:
    state = hall()

    events, result = reserve(state, "acme", host="h1", devices=[GPU], reason="evening peak")

    [made] = events
    assert isinstance(made, ReservationMade)
    assert (made.tenant, made.host, made.made_at) == ("acme", "h1", NOW)
    assert made.expires_at == NOW + timedelta(seconds=RESERVATION_SECONDS)
    assert [b.device for b in made.devices] == ["g1"]  # what compose would choose
    assert result.reservation_id == made.reservation_id and result.state == "held"
    assert [d.id for d in result.devices] == ["g1"] and result.reason == "evening peak"
    after = apply(state, events)
    assert after.reserved_by == {"g1": made.reservation_id}
    assert after.held == {"acme": {"gpu": Held(count=1)}}  # counted against quota
    assert "g1" not in free_ids(after)
    assert after.compositions == {}  # nothing is composed, no path is held
    assert after.reserved_gbps == {}


def test_a_reservation_lasts_the_duration_asked_for() -> None:
    events, _ = reserve(hall(), "acme", host="h1", devices=[GPU], duration=30)

    assert events[0].expires_at == NOW + timedelta(seconds=30)


def test_a_reserved_device_is_not_free_to_another_tenant_and_the_refusal_names_it_reserved() -> (
    None
):
    state, _ = reserved(hall(), "acme", host="h1", device_ids=["g2"])

    events, error = compose_pending(state, "globex", host="h2", device_ids=["g2"])

    assert isinstance(error, IntentRejected) and error.code == "no_capacity"
    assert error.details["held"] == "reserved"
    assert "g2 is reserved" in error.message
    assert [type(e) for e in events] == [CompositionRejected]
    assert "acme" not in error.message and "rsv-" not in error.message  # no holder named


def test_a_device_in_use_is_named_in_use_not_reserved() -> None:
    state, _ = composed(hall(), "acme", host="h1", device_ids=["g2"])

    _, error = compose_pending(state, "globex", host="h2", device_ids=["g2"])

    assert error.details["held"] == "composed" and "g2 is in use" in error.message


def test_compose_by_kind_passes_reserved_devices_by() -> None:
    state, _ = reserved(hall(), "acme", host="h1", devices=[{"kind": "gpu", "count": 2}])

    _, result = compose(state, "globex", host="h2", devices=[GPU])
    _, none_left = compose_pending(
        state, "globex", host="h2", devices=[{"kind": "gpu", "count": 2}]
    )

    assert [d.id for d in result.devices] == ["g3"]
    assert none_left.code == "no_capacity"


def test_nobody_reserves_what_is_reserved() -> None:
    state, _ = reserved(hall(), "acme", host="h1", device_ids=["g1"])

    events, error = reserve(state, "globex", host="h2", device_ids=["g1"])

    assert error.code == "no_capacity" and error.details["held"] == "reserved"
    assert [type(e) for e in events] == [CompositionRejected]


@pytest.mark.parametrize(
    ("manifest", "code"),
    [
        ({"host": "h1", "device_ids": ["g1", "g1"]}, "invalid"),
        ({"host": "h1", "device_ids": ["g9"]}, "not_found"),
        ({"host": "h9", "devices": [GPU]}, "not_found"),
        ({"devices": [GPU]}, "invalid"),
        ({"host": "h1"}, "invalid"),
        ({"host": "h1", "devices": [{"kind": "memory"}]}, "invalid"),
    ],
)
def test_a_malformed_reserve_writes_nothing(manifest: dict[str, Any], code: str) -> None:
    events, error = reserve(hall(), "acme", **manifest)

    assert isinstance(error, IntentRejected) and error.code == code
    assert events == []


def test_a_reserve_nothing_can_serve_is_recorded_like_a_refused_compose() -> None:
    events, error = reserve(hall(), "acme", host="h1", devices=[{"kind": "gpu", "count": 4}])

    assert error.code == "no_capacity" and error.details["funnel"]
    [event] = events
    assert isinstance(event, CompositionRejected) and event.code == "no_capacity"


def test_a_reservation_counts_against_quota() -> None:
    state = apply(hall(), [QuotaSet(tenant="acme", kind="gpu", count=1)])
    state, _ = reserved(state, "acme", host="h1", devices=[GPU])

    _, over = compose_pending(state, "acme", host="h1", devices=[GPU])
    _, over_too = reserve(state, "acme", host="h1", devices=[GPU])

    assert over.code == "quota" and over_too.code == "quota"


def test_the_intent_bodies_are_strict() -> None:
    with pytest.raises(InvalidIntent, match="exactly one"):
        decode_intent("intent", "apply", b'{"request_id": "r"}')
    with pytest.raises(InvalidIntent, match="exactly one"):
        decode_intent(
            "intent", "apply", b'{"request_id": "r", "reservation_id": "x", "manifest": {}}'
        )
    with pytest.raises(InvalidIntent, match="duration_seconds"):
        decode_intent(
            "intent", "reserve", b'{"request_id": "r", "manifest": {}, "duration_seconds": 0}'
        )
    with pytest.raises(InvalidIntent, match="unknown field"):
        decode_intent("intent", "reserve", b'{"request_id": "r", "manifest": {"hots": "h1"}}')
    with pytest.raises(InvalidIntent, match="reservation_id"):
        decode_intent("intent", "cancel-reservation", b'{"request_id": "r"}')


# ---- memory slices ----


def test_a_reserved_slice_leaves_the_rest_of_the_pool_free() -> None:
    mem = {"kind": "memory", "capacity_gib": 768}
    state, made = reserved(hall(), "acme", host="h1", devices=[mem])

    [pool] = [d for d in queries.free(state, "memory").devices]
    _, too_much = reserve(state, "globex", host="h2", devices=[{**mem, "capacity_gib": 512}])
    _, fits = compose(state, "globex", host="h2", devices=[{**mem, "capacity_gib": 256}])

    assert state.reserved_gib == {"m1": 768} and pool.free_gib == 256
    assert too_much.code == "no_capacity"
    assert fits.state == "active"
    assert made.devices[0].capacity_gib == 768


def test_applying_a_slice_composes_that_slice_of_that_pool() -> None:
    b = FabricBuilder().host("h1").switch("sw").memory("m1", 1024).memory("m2", 1024)
    for node in ("h1", "m1", "m2"):
        b.link(node, "sw")
    state, made = reserved(
        b.state(), "acme", host="h1", devices=[{"kind": "memory", "capacity_gib": 512}]
    )

    events, _ = apply_reservation(state, "acme", made.reservation_id)

    [binding] = next(e for e in events if isinstance(e, DevicesReserved)).devices
    assert (binding.device, binding.capacity_gib) == ("m1", 512)
    after = apply(state, events)
    assert after.memory_used == {"m1": 512} and after.reserved_gib == {}


# ---- apply ----


def test_apply_composes_exactly_the_reserved_devices() -> None:
    state, held = composed(hall(), "globex", host="h2", device_ids=["g1"])
    state, made = reserved(
        state,
        "acme",
        host="h1",
        devices=[{"kind": "gpu", "count": 2}],
        lease_seconds=60,
        labels={"w": "decode"},
    )
    # g1, which the path core would prefer, is free again: the reservation's devices still win.
    state = apply(state, release(state, "globex", held.composition_id)[0])

    events, result = apply_reservation(
        state, "acme", made.reservation_id, now=NOW + timedelta(seconds=5)
    )

    assert [type(e) for e in events][:2] == [ReservationApplied, CompositionRequested]
    assert events[0] == ReservationApplied(
        reservation_id=made.reservation_id, composition_id=result.composition_id
    )
    requested = events[1]
    assert requested.request.labels == {"w": "decode"}
    assert requested.expires_at == NOW + timedelta(seconds=65)  # the lease runs from apply
    assert isinstance(result, ComposeResult) and result.state == "pending"
    assert [d.id for d in result.devices] == ["g2", "g3"]
    reserved_event = next(e for e in events if isinstance(e, DevicesReserved))
    assert [b.entry for b in reserved_event.devices] == [0, 0]  # repairs find the entry
    after = apply(state, events)
    assert after.reservations == {} and after.reserved_by == {}
    assert after.device_owner == {"g2": result.composition_id, "g3": result.composition_id}
    assert after.held == {"acme": {"gpu": Held(count=2)}}  # moved, not doubled
    assert after.ended_reservations[made.reservation_id].end == "applied"


def test_an_applied_reservation_settles_as_a_compose_and_releases_as_one() -> None:
    state, made = reserved(hall(), "acme", host="h1", devices=[GPU])
    events, result = apply_reservation(state, "acme", made.reservation_id)
    state = apply(state, events)
    cid = result.composition_id
    settle = EstablishComposition(request_id=settle_request_id(cid), composition_id=cid)
    more, settled = run(state, settle, "engine")
    state = apply(state, more)

    done, _ = release(state, "acme", cid)

    assert settled.state == "active"
    assert "g1" in free_ids(apply(state, done))


def test_apply_by_manifest_composes_directly() -> None:
    intent = msgspec.convert(
        {"request_id": request_id(), "manifest": {"host": "h1", "devices": [GPU]}}, Apply
    )

    events, result = run(hall(), intent, "acme")

    assert [type(e) for e in events] == [CompositionRequested, DevicesReserved]
    assert result.state == "pending" and [d.id for d in result.devices] == ["g1"]


def test_another_tenants_reservation_is_not_found_on_apply_and_cancel() -> None:
    state, made = reserved(hall(), "acme", host="h1", devices=[GPU])

    for events, error in (
        apply_reservation(state, "globex", made.reservation_id),
        cancel(state, "globex", made.reservation_id),
        apply_reservation(state, "acme", "rsv-nothing"),
    ):
        assert events == [] and error.code == "not_found"
    _, other = apply_reservation(state, "globex", made.reservation_id)
    _, unknown = apply_reservation(state, "globex", "rsv-nothing")
    assert other.message == unknown.message.replace("rsv-nothing", made.reservation_id)


@pytest.mark.parametrize("verb", [apply_reservation, cancel], ids=["apply", "cancel"])
def test_an_expired_reservation_is_conflict_before_and_after_the_expiry_is_recorded(
    verb: Any,
) -> None:
    """A cancel in the moment between the deadline and the expiry tick recorded a
    ReservationCancelled: the reservation then read "was cancelled" though its time was up."""
    state, made = reserved(hall(), "acme", host="h1", devices=[GPU], duration=60)
    later = NOW + timedelta(seconds=60)

    events, before = verb(state, "acme", made.reservation_id, now=later)
    expired, _ = run(state, ExpireReservations(request_id="x"), "engine", later)
    state = apply(state, expired)
    events_after, after = verb(state, "acme", made.reservation_id, now=later)

    assert events == [] and events_after == []
    for error in (before, after):
        assert error.code == "conflict" and error.details["state"] == "expired"
        assert "expired" in error.message
    assert expired == [ReservationExpired(reservation_id=made.reservation_id)]


def test_a_reservation_applies_once() -> None:
    state, made = reserved(hall(), "acme", host="h1", devices=[GPU])
    events, first = apply_reservation(state, "acme", made.reservation_id)
    state = apply(state, events)

    again, error = apply_reservation(state, "acme", made.reservation_id)

    assert again == [] and error.code == "conflict"
    assert error.details == {
        "reservation_id": made.reservation_id,
        "state": "applied",
        "expires_at": error.details["expires_at"],
        "composition_id": first.composition_id,
    }


def test_an_apply_no_path_serves_is_recorded_and_the_reservation_stays() -> None:
    state, made = reserved(hall(), "acme", host="h1", device_ids=["g1"])
    events, _ = report_fault(state, "g1")
    state = apply(state, events)

    refused, error = apply_reservation(state, "acme", made.reservation_id)

    assert error.code == "no_capacity" and error.details["reservation_id"] == made.reservation_id
    assert [type(e) for e in refused] == [CompositionRejected]
    assert made.reservation_id in apply(state, refused).reservations


# ---- cancel and expire ----


def test_cancel_gives_the_devices_back_once() -> None:
    state, made = reserved(hall(), "acme", host="h1", devices=[GPU])

    events, result = cancel(state, "acme", made.reservation_id)
    state = apply(state, events)
    again, error = cancel(state, "acme", made.reservation_id)

    assert events == [ReservationCancelled(reservation_id=made.reservation_id, reason="cancelled")]
    assert (result.state, result.devices) == ("cancelled", ["g1"])
    assert "g1" in free_ids(state) and state.held == {}
    assert again == [] and (error.code, error.details["state"]) == ("conflict", "cancelled")


def test_expiry_ends_only_the_reservations_that_are_due_oldest_first() -> None:
    state = hall()
    state, long = _reserve_for(state, "acme", "g1", 100)
    state, short = _reserve_for(state, "globex", "g2", 10)
    state, middle = _reserve_for(state, "acme", "g3", 50)

    events, result = run(
        state, ExpireReservations(request_id="x"), "engine", NOW + timedelta(seconds=50)
    )

    assert events == [
        ReservationExpired(reservation_id=short.reservation_id),
        ReservationExpired(reservation_id=middle.reservation_id),
    ]
    assert result == {"expired": [short.reservation_id, middle.reservation_id]}
    after = apply(state, events)
    assert list(after.reservations) == [long.reservation_id]
    assert reservations.due_reservations(after, NOW + timedelta(seconds=50)) == []


def _reserve_for(
    state: DomainState, tenant: str, device: str, seconds: int
) -> tuple[DomainState, Any]:
    events, result = reserve(state, tenant, host="h1", device_ids=[device], duration=seconds)
    assert isinstance(result, ReservationResult)
    return apply(state, events), result


# ---- queries ----


def test_preview_chooses_as_reserve_does_and_writes_nothing() -> None:
    state = hall()
    manifest = {"host": "h1", "devices": [{"kind": "gpu", "count": 2}]}

    shown = queries.answer(state, msgspec.convert({"manifest": manifest}, PreviewQuery), "preview")
    _, made = reserve(state, "acme", **manifest)

    assert shown.host == made.host == "h1"
    assert shown.devices == made.devices


def test_preview_refuses_as_compose_would_without_recording() -> None:
    state, _ = reserved(hall(), "acme", host="h1", device_ids=["g1"])
    query = msgspec.convert({"manifest": {"host": "h2", "device_ids": ["g1"]}}, PreviewQuery)

    with pytest.raises(IntentRejected) as refused:
        queries.answer(state, query, "preview")

    assert refused.value.code == "no_capacity" and refused.value.details["held"] == "reserved"


def test_a_tenant_previews_and_lists_as_itself() -> None:
    state, mine = reserved(hall(), "acme", host="h1", device_ids=["g1"])
    state, theirs = reserved(state, "globex", host="h2", device_ids=["g2"])
    asked = ReservationsQuery()

    everything = queries.answer(state, asked, "reservations")
    as_acme = views.scope(
        "reservations",
        queries.answer(state, views.scoped_query(asked, "acme"), "reservations"),
        "acme",
        state,
    )
    sneaky = views.scoped_query(ReservationsQuery(tenant="globex"), "acme")
    scoped_sneaky = views.scope(
        "reservations", queries.answer(state, sneaky, "reservations"), "acme", state
    )
    preview = views.scoped_query(
        msgspec.convert(
            {"manifest": {"host": "h1", "devices": [GPU]}, "tenant": "globex"}, PreviewQuery
        ),
        "acme",
    )

    assert [r.reservation_id for r in everything.reservations] == sorted(
        [mine.reservation_id, theirs.reservation_id]
    )
    assert [r.reservation_id for r in as_acme.reservations] == [mine.reservation_id]
    assert scoped_sneaky.reservations == []
    assert preview.tenant == "acme"


# ---- the stored contract ----


@pytest.mark.parametrize(
    "name", ["ReservationMade", "ReservationApplied", "ReservationCancelled", "ReservationExpired"]
)
def test_v1_reservation_payloads_as_first_written_still_decode_and_fold(name: str) -> None:
    """Stored events are contracts forever: the payloads checked in with the first version
    decode into today's Structs, and a log of them folds."""
    payloads = Path(__file__).parent / "payloads" / "v1"
    event = upcast(name, 1, (payloads / f"{name}.json").read_bytes())
    made = upcast("ReservationMade", 1, (payloads / "ReservationMade.json").read_bytes())
    b = FabricBuilder().host("host-01").switch("sw-r1").gpu("gpu-042")
    state = apply(b.chain("host-01", "sw-r1", "gpu-042").state(), [made])
    assert type(event).__name__ == name
    assert state.reserved_by == {"gpu-042": "rsv-0123456789abcdef"}
    if name != "ReservationMade":
        assert apply(state, [event]).reserved_by == {}


# ---- the fabric under a reservation ----


def test_a_reserved_device_is_neither_removed_nor_respecified_but_its_paths_are_free() -> None:
    state, made = reserved(hall(), "acme", host="h1", device_ids=["g1"])
    b = FabricBuilder().host("h1").host("h2").switch("sw")
    b.gpu("g1", model="B200").gpu("g2").gpu("g3").memory("m1", 1024)
    for node in ("h1", "h2", "g1", "g2", "g3", "m1"):
        b.link(node, "sw")
    changed = ImportTopology(request_id=request_id(), nodes=list(b.nodes.values()), links=b.links)

    removed, gone = run(state, Remove(request_id=request_id(), id="g1"))
    respecified, respec = run(state, changed)
    _, path_removed = run(state, Remove(request_id=request_id(), id="l-03"))  # g1's cable

    for events, error in ((removed, gone), (respecified, respec)):
        assert events == [] and error.code == "conflict"
        assert error.details == {"reserved": ["g1"], "reservations": [made.reservation_id]}
    assert not isinstance(path_removed, IntentRejected)  # a reservation holds no path


def test_an_ended_reservation_is_remembered_for_a_day_then_unknown() -> None:
    state, old = reserved(hall(), "acme", host="h1", device_ids=["g1"])
    state = apply(state, cancel(state, "acme", old.reservation_id)[0])
    day_later = NOW + timedelta(days=1, seconds=RESERVATION_SECONDS + 1)
    events, newer = reserve(state, "acme", now=day_later, host="h1", device_ids=["g2"])
    state = apply(state, events)
    state = apply(state, cancel(state, "acme", newer.reservation_id)[0])

    _, forgotten = apply_reservation(state, "acme", old.reservation_id, now=day_later)
    _, remembered = apply_reservation(state, "acme", newer.reservation_id, now=day_later)

    assert forgotten.code == "not_found" and remembered.code == "conflict"
    assert list(state.ended_reservations) == [newer.reservation_id]
