"""The KV bucket's keys and values, derived purely from the events: the state before and after
each one, and the compositions' conditions from the events' times and positions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from core.fabric_builder import (
    DOMAIN,
    FabricBuilder,
    compose,
    compose_pending,
    release,
    report_fault,
    run,
)

from trellis.adapters.nats.kv_state import KeyChange, View, changes, coalesce, everything, fold
from trellis.engine.core.events import (
    ComponentRemoved,
    CompositionReleased,
    Event,
    LeaseExpired,
    ReservationCancelled,
    ReservationExpired,
    TopologyImported,
)
from trellis.engine.core.intents import Apply, FailComposition, Reserve, settle_request_id
from trellis.engine.core.records import format_time
from trellis.engine.core.state import DomainState

START = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def recorded(position: int) -> datetime:
    """When the event at `position` was recorded: a second apart, as no wall clock reads."""
    return START + timedelta(seconds=position)


def hall() -> DomainState:
    """h - sw - {g1, g2, mem}: two GPUs and a memory pool behind one switch."""
    b = FabricBuilder().host("h").switch("sw").gpu("g1", generation=8).gpu("g2", generation=9)
    b.memory("mem", capacity_gib=1024)
    b.link("h", "sw", id="l-h").link("sw", "g1", id="l-1").link("sw", "g2", id="l-2")
    b.link("sw", "mem", id="l-m")
    return b.state()


def played(
    start: DomainState | View, events: list[Event], first: int = 1
) -> tuple[View, list[KeyChange]]:
    """Fold `events` one by one as the relay does; every key change, positions `first`, ..."""
    view = start if isinstance(start, View) else View(state=start)
    out: list[KeyChange] = []
    for position, event in enumerate(events, start=first):
        after = fold(view, event, recorded(position), position)
        out += changes(view, after, event, position)
        view = after
    return view, out


def composed_view(state: DomainState, tenant: str, **body: Any) -> tuple[View, Any, int]:
    """A compose that must succeed, folded from `state`: the view, the result and the next
    free position."""
    events, result = compose(state, tenant, **body)
    assert result.state == "active", result
    view, _ = played(state, events)
    return view, result, len(events) + 1


def decoded(value: bytes | None) -> dict[str, Any] | None:
    return None if value is None else msgspec.json.decode(value)


def last_values(changed: list[KeyChange]) -> dict[str, dict[str, Any] | None]:
    return {key: decoded(value) for key, value in changed}


def test_the_first_import_writes_every_device_and_host_and_nothing_else() -> None:
    b = FabricBuilder().host("h").switch("sw").gpu("g1").memory("mem", capacity_gib=512)
    imported = b.chain("h", "sw", "g1").imported()

    _, changed = played(DomainState(domain=DOMAIN), [imported])

    values = last_values(changed)
    assert sorted(values) == [f"{DOMAIN}.device.g1", f"{DOMAIN}.device.mem", f"{DOMAIN}.host.h"]
    assert values[f"{DOMAIN}.device.g1"] == {
        "kind": "gpu", "model": "H100", "health": "healthy", "drained": False, "owner": None,
        "free": True, "capacity_gib": None, "free_gib": None, "position": 1, "reservation": None,
    }  # fmt: skip
    assert values[f"{DOMAIN}.device.mem"] is not None
    assert values[f"{DOMAIN}.device.mem"]["free_gib"] == 512
    assert values[f"{DOMAIN}.host.h"] == {
        "health": "healthy", "drained": False, "compositions": [], "position": 1,
    }  # fmt: skip


def test_a_compose_writes_the_composition_its_devices_and_its_host() -> None:
    events, result = compose(
        hall(), "acme", host="h", devices=[{"kind": "gpu"}, {"kind": "memory", "capacity_gib": 256}]
    )
    cid = result.composition_id

    _, changed = played(hall(), events)

    key = f"{DOMAIN}.composition.{cid}"
    states = [msgspec.json.decode(v)["state"] for k, v in changed if k == key and v]
    assert states[0] == "pending" and states[-1] == "active"
    values = last_values(changed)
    composition = values[f"{DOMAIN}.composition.{cid}"]
    assert composition is not None
    assert composition["tenant"] == "acme" and composition["host"] == "h"
    assert composition["devices"] == [
        {"id": "g1", "kind": "gpu", "path": ["h", "sw", "g1"], "capacity_gib": None},
        {"id": "mem", "kind": "memory", "path": ["h", "sw", "mem"], "capacity_gib": 256},
    ]
    g1, mem = values[f"{DOMAIN}.device.g1"], values[f"{DOMAIN}.device.mem"]
    assert g1 is not None and g1["owner"] == cid and g1["free"] is False
    assert mem is not None and mem["owner"] is None and mem["free_gib"] == 768 and mem["free"]
    assert values[f"{DOMAIN}.host.h"] == {
        "health": "healthy", "drained": False, "compositions": [cid], "position": 1,
    }  # fmt: skip
    assert f"{DOMAIN}.device.g2" not in values  # untouched keys are not written


def test_a_release_writes_the_final_state_then_deletes_the_key_and_frees_the_devices() -> None:
    view, result, next_position = composed_view(hall(), "acme", host="h", device_ids=["g2"])
    cid = result.composition_id
    events, _ = release(view.state, "acme", cid)

    _, changed = played(view, events, next_position)

    key = f"{DOMAIN}.composition.{cid}"
    mine = [(k, decoded(v)) for k, v in changed if k == key]
    assert len(mine) == 2
    final, gone = mine
    assert final[1] is not None and final[1]["state"] == "released"
    assert final[1]["devices"][0]["id"] == "g2"  # what it held, for the record
    assert gone == (key, None)
    values = last_values(changed)
    assert values[f"{DOMAIN}.device.g2"]["owner"] is None  # type: ignore[index]
    assert values[f"{DOMAIN}.device.g2"]["free"] is True  # type: ignore[index]
    assert values[f"{DOMAIN}.host.h"]["compositions"] == []  # type: ignore[index]


def test_a_fault_on_a_used_device_shows_on_the_device_and_on_the_impaired_composition() -> None:
    view, result, next_position = composed_view(hall(), "acme", host="h", device_ids=["g1"])
    events, _ = report_fault(view.state, "g1", "degraded")

    _, changed = played(view, events, next_position)

    values = last_values(changed)
    assert values[f"{DOMAIN}.device.g1"]["health"] == "degraded"  # type: ignore[index]
    composition = values[f"{DOMAIN}.composition.{result.composition_id}"]
    assert composition is not None and composition["state"] == "impaired"
    assert composition["impaired_by"] == ["g1"]


def test_a_fault_on_a_switch_alone_changes_no_key() -> None:
    _, changed = played(hall(), report_fault(hall(), "sw")[0])

    assert changed == []


def test_a_reimport_of_the_same_document_changes_no_key() -> None:
    state = hall()
    same = TopologyImported(
        nodes=[n.spec for n in state.nodes.values()], links=[lk.spec for lk in state.links.values()]
    )

    assert played(state, [same])[1] == []


def test_a_removed_device_has_its_key_deleted() -> None:
    event = ComponentRemoved(component="g2", kind="node", links=["l-2"])

    assert played(hall(), [event])[1] == [(f"{DOMAIN}.device.g2", None)]


def test_a_batch_comes_down_to_each_keys_last_value_and_an_ended_key_to_its_end() -> None:
    changed: list[KeyChange] = [
        ("d.composition.c1", b"pending"),
        ("d.device.g1", b"owned"),
        ("d.composition.c1", b"active"),
        ("d.composition.c1", b"released"),
        ("d.composition.c1", None),
        ("d.device.g1", b"free"),
        ("d.device.g2", None),
        ("d.device.g3", None),
        ("d.device.g3", b"added again"),
    ]

    assert coalesce(changed) == {
        "d.composition.c1": [b"released", None],  # the end, then gone
        "d.device.g1": [b"free"],
        "d.device.g2": [None],
        "d.device.g3": [b"added again"],
    }


# ---- conditions (engine/core/conditions.py) ----


def conditions_of(changed: list[KeyChange], cid: str) -> list[dict[str, dict[str, Any]]]:
    """Each value the composition's key was given, as its conditions by type."""
    key = f"{DOMAIN}.composition.{cid}"
    values = [decoded(v) for k, v in changed if k == key and v is not None]
    return [{c["type"]: c for c in value["conditions"]} for value in values if value]


def status(conditions: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {t: c["status"] for t, c in conditions.items()}


def when(position: int) -> str:
    return format_time(recorded(position))


def test_a_compose_is_bound_and_pending_then_established_and_ready() -> None:
    events, result = compose(hall(), "acme", host="h", devices=[{"kind": "gpu"}] * 2)
    types = [type(e).__name__ for e in events]
    reserved, activated = (
        types.index("DevicesReserved") + 1,
        types.index("CompositionActivated") + 1,
    )

    _, changed = played(hall(), events)

    steps = conditions_of(changed, result.composition_id)
    pending, active = steps[types.index("DevicesReserved")], steps[-1]
    assert list(pending) == ["Bound", "PathEstablished", "Ready", "Impaired", "Failed"]
    assert status(pending) == {
        "Bound": "True", "PathEstablished": "False", "Ready": "False", "Impaired": "False",
        "Failed": "False",
    }  # fmt: skip
    assert pending["Bound"]["reason"] == "DevicesReserved"
    assert pending["Bound"]["message"] == "2 devices reserved: g1, g2"
    # Told what it waits for now, without a transition of its own.
    assert (pending["PathEstablished"]["reason"], pending["PathEstablished"]["message"]) == (
        "Establishing",
        "0 of 2 paths established",
    )
    assert pending["PathEstablished"]["observed_position"] == 1
    assert (pending["Bound"]["last_transition_time"], pending["Bound"]["observed_position"]) == (
        when(reserved),
        reserved,
    )
    # One PathEstablished of two: still False, and the message says how far it got.
    assert steps[types.index("PathEstablished")]["PathEstablished"]["message"] == (
        "1 of 2 paths established"
    )
    assert status(active) == {**status(pending), "PathEstablished": "True", "Ready": "True"}
    assert active["Ready"]["reason"] == "Activated"
    assert active["Ready"]["observed_position"] == activated
    assert active["Ready"]["last_transition_time"] == when(activated)
    assert active["Bound"] == pending["Bound"]  # no transition: time and position kept


def test_a_failed_compose_says_failed_with_the_devices_left_without_a_path() -> None:
    events, result = compose_pending(hall(), "acme", host="h", device_ids=["g1", "mem"])
    cid = result.composition_id
    view, _ = played(hall(), events)
    settle = FailComposition(
        request_id=settle_request_id(cid), composition_id=cid, step="bind", target="g1",
        error="controller said no",
    )  # fmt: skip
    failing, _ = run(view.state, settle, "engine")
    position = len(events) + 1

    _, changed = played(view, failing, position)

    final = conditions_of(changed, cid)[-1]
    # Undone: nothing is held any more, so the phases are False too.
    assert status(final) == {
        "Bound": "False", "PathEstablished": "False", "Ready": "False", "Impaired": "False",
        "Failed": "True",
    }  # fmt: skip
    assert (final["Bound"]["reason"], final["PathEstablished"]["reason"]) == ("Failed", "Failed")
    failed = final["Failed"]
    assert failed["reason"] == "CompositionFailed"
    assert "bind g1" in failed["message"] and "controller said no" in failed["message"]
    assert failed["components"] == ["g1", "mem"]
    assert (failed["last_transition_time"], failed["observed_position"]) == (
        when(position),
        position,
    )
    assert final["Ready"]["reason"] == "Failed"


def test_an_impaired_composition_names_what_impairs_it_and_is_ready_again_once_repaired() -> None:
    view, result, position = composed_view(hall(), "acme", host="h", device_ids=["g1"])
    cid = result.composition_id
    first, _ = report_fault(view.state, "g1", "degraded", "ecc errors")
    view, changed = played(view, first, position)
    impaired = conditions_of(changed, cid)[-1]
    position += len(first)
    second, _ = report_fault(view.state, "l-h", "failed", "cable cut")
    view, changed = played(view, second, position)
    worse = conditions_of(changed, cid)[-1]
    position += len(second)
    mended, _ = report_fault(view.state, "g1", "healthy")  # l-h is still down: impaired
    view, changed = played(view, mended, position)
    position += len(mended)
    healed, _ = report_fault(view.state, "l-h", "healthy")
    _, changed = played(view, healed, position)
    ready = conditions_of(changed, cid)[-1]

    assert status(impaired)["Impaired"] == "True" and status(impaired)["Ready"] == "False"
    assert impaired["Impaired"]["reason"] == "ComponentUnusable"
    assert impaired["Impaired"]["components"] == ["g1"]
    assert impaired["Ready"]["reason"] == "Impaired"
    # A second fault adds to what impairs it; still impaired, so no new transition.
    assert worse["Impaired"]["components"] == ["g1", "l-h"]
    assert worse["Impaired"]["last_transition_time"] == impaired["Impaired"]["last_transition_time"]
    assert status(ready)["Ready"] == "True" and status(ready)["Impaired"] == "False"
    assert ready["Impaired"]["reason"] == "Repaired" and ready["Impaired"]["components"] == []
    assert ready["Ready"]["observed_position"] > worse["Impaired"]["observed_position"]


def test_an_active_composition_waits_for_nothing_and_a_replaced_device_is_the_one_bound() -> None:
    events, result = compose(hall(), "acme", host="h", devices=[{"kind": "gpu"}])
    cid = result.composition_id
    (chosen,) = [d.id for d in result.devices]
    spare = ({"g1", "g2"} - {chosen}).pop()
    view, changed = played(hall(), events)
    active = conditions_of(changed, cid)[-1]
    repaired, _ = report_fault(view.state, chosen, "failed", "fell off the bus")
    assert "DeviceReplaced" in [type(e).__name__ for e in repaired]

    _, changed = played(view, repaired, len(events) + 1)
    final = conditions_of(changed, cid)[-1]

    # Once active, nothing is still "waiting for its devices".
    assert (active["Failed"]["status"], active["Failed"]["reason"]) == ("False", "Established")
    assert (active["Impaired"]["status"], active["Impaired"]["reason"]) == ("False", "PathsUsable")
    assert all("waiting" not in c["message"] for c in active.values())
    # Bound names the device the repair bound, and why, with no transition (still True):
    # the repair and the activation after it are one batch, so one value must tell it all.
    assert (final["Bound"]["reason"], final["Bound"]["message"]) == (
        "DeviceReplaced",
        f"1 device reserved: {spare} ({spare} replaced {chosen}: "
        f"{chosen} failed: fell off the bus)",
    )
    assert final["Bound"]["observed_position"] == active["Bound"]["observed_position"]
    assert (final["Impaired"]["reason"], final["Impaired"]["message"]) == (
        "Repaired",
        f"every path is usable again ({chosen} replaced by {spare})",
    )
    assert status(final)["Ready"] == "True" and final["PathEstablished"]["status"] == "True"


def test_a_rerouted_path_is_said_by_path_established_and_by_the_repaired_impairment() -> None:
    b = FabricBuilder().host("h").switch("s1").switch("s2").gpu("g1")
    b.link("h", "s1", id="l-1").link("s1", "g1").link("h", "s2", id="l-2").link("s2", "g1")
    state = b.state()
    view, result, position = composed_view(state, "acme", host="h", device_ids=["g1"])
    (device,) = result.devices
    cut = "l-1" if "s1" in device.path else "l-2"
    rerouted, _ = report_fault(view.state, cut, "failed", "cable cut")
    assert "PathRerouted" in [type(e).__name__ for e in rerouted]

    _, changed = played(view, rerouted, position)
    final = conditions_of(changed, result.composition_id)[-1]

    assert (final["PathEstablished"]["reason"], final["PathEstablished"]["status"]) == (
        "PathRerouted",
        "True",
    )
    assert final["PathEstablished"]["message"].startswith("the fabric holds its path (g1 rerouted")
    assert final["Impaired"]["message"] == "every path is usable again (g1 rerouted)"


def test_a_lease_that_ran_out_is_the_reason_its_release_gives() -> None:
    view, result, position = composed_view(hall(), "acme", host="h", device_ids=["g1"])
    cid = result.composition_id
    expiry = [LeaseExpired(composition_id=cid), CompositionReleased(composition_id=cid)]

    _, changed = played(view, expiry, position)

    expired, final = conditions_of(changed, cid)
    assert (expired["Ready"]["status"], expired["Ready"]["reason"]) == ("False", "LeaseExpired")
    assert final["Ready"]["reason"] == "LeaseExpired"
    # Released: it holds neither devices nor paths (a DRA driver copies these to the claim).
    assert status(final) == {
        "Bound": "False", "PathEstablished": "False", "Ready": "False", "Impaired": "False",
        "Failed": "False",
    }  # fmt: skip
    assert final["Bound"]["reason"] == "Released" and final["Bound"]["observed_position"] > 1
    assert final["Ready"]["observed_position"] == position  # the expiry was the transition


def test_a_bucket_filled_afresh_renders_the_conditions_the_events_wrote() -> None:
    view, result, position = composed_view(hall(), "acme", host="h", device_ids=["g1"])
    faulted, _ = report_fault(view.state, "g1", "degraded")
    view, changed = played(view, faulted, position)
    key = f"{DOMAIN}.composition.{result.composition_id}"

    afresh = dict(everything(view, 999))[key]
    incremental = [v for k, v in changed if k == key][-1]

    assert afresh is not None and incremental is not None
    assert decoded(afresh)["conditions"] == decoded(incremental)["conditions"]  # type: ignore[index]
    assert decoded(afresh)["conditions"]  # type: ignore[index]


# ---- reservations (`<domain>.reservation.<id>`) ----


def reserve_events(state: DomainState, tenant: str, duration: int = 60, **manifest: Any) -> Any:
    body = {"request_id": f"rsv-{tenant}", "manifest": manifest, "duration_seconds": duration}
    events, result = run(state, msgspec.convert(body, Reserve), tenant)
    assert not isinstance(result, Exception), result
    return events, result


def test_a_reservation_writes_its_key_and_its_devices_stop_being_free() -> None:
    state = hall()
    events, made = reserve_events(
        state, "acme", host="h", devices=[{"kind": "gpu"}, {"kind": "memory", "capacity_gib": 256}]
    )
    rid = made.reservation_id

    view, changed = played(state, events)

    values = last_values(changed)
    assert list(values) == [
        f"{DOMAIN}.reservation.{rid}",
        f"{DOMAIN}.device.g1",
        f"{DOMAIN}.device.mem",
    ]
    entry = values[f"{DOMAIN}.reservation.{rid}"]
    assert entry is not None
    assert (entry["tenant"], entry["host"], entry["state"]) == ("acme", "h", "held")
    assert entry["expires_at"] == format_time(made.expires_at)
    assert [d["id"] for d in entry["devices"]] == ["g1", "mem"]
    g1, mem = values[f"{DOMAIN}.device.g1"], values[f"{DOMAIN}.device.mem"]
    assert g1 is not None and (g1["free"], g1["owner"], g1["reservation"]) == (False, None, rid)
    assert mem is not None and (mem["free"], mem["free_gib"], mem["reservation"]) == (
        True,
        768,
        None,
    )
    assert dict(everything(view, 1))[f"{DOMAIN}.reservation.{rid}"] == changed[0][1]


def test_an_ended_reservation_shows_how_it_ended_then_its_key_goes() -> None:
    state = hall()
    events, made = reserve_events(state, "acme", host="h", device_ids=["g1"])
    view, _ = played(state, events)
    rid = made.reservation_id
    key = f"{DOMAIN}.reservation.{rid}"
    apply_intent = Apply(request_id="go", reservation_id=rid)
    applied_events, composed = run(view.state, apply_intent, "acme")
    for ending, how in (
        ([ReservationCancelled(reservation_id=rid)], "cancelled"),
        ([ReservationExpired(reservation_id=rid)], "expired"),
        (applied_events, "applied"),
    ):
        _, changed = played(view, ending, 2)

        writes = coalesce(changed)[key]
        assert writes[-1] is None, how
        final = decoded(writes[0])
        assert final is not None and final["state"] == how
        if how == "applied":
            assert final["composition_id"] == composed.composition_id
            g1 = last_values(changed)[f"{DOMAIN}.device.g1"]
            assert g1 is not None and (g1["owner"], g1["reservation"]) == (
                composed.composition_id,
                None,
            )
