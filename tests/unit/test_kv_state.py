"""The KV bucket's keys and values, derived purely from the state before and after each event."""

from __future__ import annotations

from typing import Any

import msgspec
from unit.fabric_builder import DOMAIN, FabricBuilder, compose, composed, release, report_fault

from trellis.adapters.nats.kv_state import KeyChange, changes, coalesce
from trellis.engine.events import ComponentRemoved, Event, TopologyImported
from trellis.engine.state import DomainState, evolve


def hall() -> DomainState:
    """h - sw - {g1, g2, mem}: two GPUs and a memory pool behind one switch."""
    b = FabricBuilder().host("h").switch("sw").gpu("g1", generation=8).gpu("g2", generation=9)
    b.memory("mem", capacity_gib=1024)
    b.link("h", "sw", id="l-h").link("sw", "g1", id="l-1").link("sw", "g2", id="l-2")
    b.link("sw", "mem", id="l-m")
    return b.state()


def played(state: DomainState, events: list[Event]) -> tuple[DomainState, list[KeyChange]]:
    """Fold `events` one by one as the relay does; every key change, positions 1, 2, ..."""
    out: list[KeyChange] = []
    for position, event in enumerate(events, start=1):
        after = evolve(state, event)
        out += changes(state, after, event, position)
        state = after
    return state, out


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
        "free": True, "capacity_gib": None, "free_gib": None, "position": 1,
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
    state, result = composed(hall(), "acme", host="h", device_ids=["g2"])
    cid = result.composition_id
    events, _ = release(state, "acme", cid)

    _, changed = played(state, events)

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
    state, result = composed(hall(), "acme", host="h", device_ids=["g1"])
    events, _ = report_fault(state, "g1", "degraded")

    _, changed = played(state, events)

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
