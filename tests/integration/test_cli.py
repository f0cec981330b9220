"""The `trellis` command against a running engine, as an operator would type it."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from harness import Harness, cli_env, serving
from harness import run_cli as trellis

from trellis.adapters.fabric.sim import SimulatedFabric
from trellis.adapters.postgres.migrations import migration_files
from trellis.engine.core.fabric import FabricBinding

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fabric.json"
DOMAIN = "hall-1"


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(nats_url, database_url, pg_schema, subject_prefix) as harness:
        yield harness


@pytest.fixture
def env(
    tmp_path: Path, nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> dict[str, str]:
    """The CLI's environment: the test's servers, and a data dir of its own, so nothing in
    the developer's (a secured ~/.local/share/trellis, TRELLIS_* variables) changes what it
    does: from a secured data dir the CLI would connect with that dir's identities."""
    return cli_env(
        tmp_path / "data", nats_url, database_url, pg_schema, subject_prefix, TRELLIS_DOMAIN=DOMAIN
    )


async def test_an_operator_imports_composes_asks_why_and_releases(
    h: Harness, env: dict[str, str]
) -> None:
    code, out, _ = await trellis(env, "topology", "import", str(EXAMPLE))
    assert code == 0 and "imported 26 nodes, 28 links" in out

    code, out, _ = await trellis(env, "topology", "show")
    assert code == 0 and "sw-pool" in out and "ocs-1:4" in out

    code, out, _ = await trellis(
        env, "compose", "--host", "host-01", "--gpu", "2", "--memory", "256",
        "--tenant", "acme", "--reason", "decode", "--lease", "600", "--json",
        "--composition-label", "job=decode-7",
    )  # fmt: skip
    assert code == 0, out
    composed = json.loads(out)  # -o json (--json): the result alone
    composed_at = (await h.store.head(DOMAIN)).position
    cid = composed["composition_id"]
    devices = [d["id"] for d in composed["devices"]]
    assert len(devices) == 3

    code, out, _ = await trellis(env, "connections", "--tenant", "acme")
    assert code == 0 and all(d in out for d in devices) and cid in out
    # --composition-label labels the composition itself (--label constrains devices).
    shown = (await h.client.query(DOMAIN, "composition", {"id": cid}))["result"]
    assert shown["labels"] == {"job": "decode-7"}, shown

    code, out, _ = await trellis(env, "why", devices[0])
    assert code == 0 and "host-01" in out and "CompositionRequested" in out

    code, out, _ = await trellis(env, "blast-radius", "sw-r1")
    assert code == 0 and cid in out and "acme" in out

    code, out, _ = await trellis(env, "free", "--kind", "gpu")
    assert code == 0 and devices[0] not in out

    code, out, _ = await trellis(env, "extend", cid, "--lease", "60", "--tenant", "acme")
    assert code == 0 and "extended at position" in out and "now expires at" in out, out

    code, out, _ = await trellis(env, "release", cid, "--tenant", "acme")
    assert code == 0 and "released" in out
    # Released twice: not found, as the contract has it, and the CLI says why (a front-door
    # probe read "no composition" as a wrong id). To another tenant it stays unknown.
    code, _, err = await trellis(env, "release", cid, "--tenant", "acme")
    assert code == 1 and "not_found" in err, err
    assert f"(composition {cid} was released at position " in err and "nothing to release" in err
    assert "asked as tenant" not in err, err
    code, _, err = await trellis(env, "extend", cid, "--lease", "60", "--tenant", "globex")
    assert code == 1 and "asked as tenant 'globex'" in err and "was released" not in err, err

    code, out, _ = await trellis(env, "history", "--id", cid)
    assert code == 0 and all(d in out for d in devices) and "released" in out, out
    assert "3 intervals" in out
    # As `why` takes it, a positional id (kubectl's habit; the first-time user probe).
    assert (await trellis(env, "history", cid))[1] == out
    code, _, err = await trellis(env, "history", cid, "--id", devices[0])
    assert code == 2 and "two values" in err, err
    code, out, _ = await trellis(env, "history", "--id", cid, "--at", str(composed_at))
    assert code == 0 and out.count("(held)") == 3 and "released" not in out, out
    code, out, _ = await trellis(env, "history", "--device", devices[0], "--view", "globex")
    assert code == 0 and "0 intervals" in out, out
    # A malformed time is the command line's mistake, as --at's is (the auditor probe: it
    # was sent, and came back exit 1 invalid).
    code, _, err = await trellis(env, "history", "--since", "yesterday")
    assert code == 2 and "trellis: usage:" in err and "not an ISO time" in err, err
    code, out, _ = await trellis(env, "history", "--id", cid, "--since", "2000-01-01T00:00:00Z")
    assert code == 0 and "3 intervals" in out, out


async def test_an_auditor_replays_a_past_moment_and_asks_why_then(
    h: Harness, env: dict[str, str]
) -> None:
    await trellis(env, "topology", "import", str(EXAMPLE))
    code, out, _ = await trellis(
        env, "compose", "--host", "host-01", "--gpu", "1", "--tenant", "acme", "--json"
    )
    composed = json.loads(out)
    cid, gpu = composed["composition_id"], composed["devices"][0]["id"]
    while_held = (await h.store.head(DOMAIN)).position
    code, out, _ = await trellis(env, "release", cid, "--tenant", "acme")
    assert code == 0

    code, out, _ = await trellis(env, "replay", "--at", str(while_held))
    assert code == 0, out
    assert f"as of log position {while_held}" in out
    assert "sw-pool" in out and cid in out and gpu in out
    code, out, _ = await trellis(env, "why", gpu, "--at", str(while_held))
    assert code == 0 and f"in composition {cid}" in out
    code, out, _ = await trellis(env, "why", gpu)
    assert code == 0 and "connected to nothing" in out
    code, out, _ = await trellis(env, "connections")
    assert code == 0 and cid not in out

    code, _, err = await trellis(env, "replay", "--at", "2020-01-01T00:00:00Z")
    assert code == 1 and "error [not_found]" in err and "did not exist yet" in err


async def test_a_refusal_prints_the_why_not_funnel_and_exits_non_zero(
    h: Harness, env: dict[str, str]
) -> None:
    await trellis(env, "topology", "import", str(EXAMPLE))
    code, _, err = await trellis(
        env, "compose", "--host", "host-01", "--gpu", "9", "--model", "B200"
    )
    assert code == 1
    assert "error [no_capacity]" in err
    assert "kind and model" in err and "bandwidth" in err


async def test_an_operator_sets_shows_and_clears_a_quota(h: Harness, env: dict[str, str]) -> None:
    await trellis(env, "topology", "import", str(EXAMPLE))
    gpu = ["compose", "--host", "host-01", "--gpu", "1", "--tenant", "acme"]

    code, out, _ = await trellis(env, "quota", "set", "acme", "gpu", "--count", "1")
    assert code == 0 and "quota of acme for gpu: 1 device; holds 0 devices" in out, out
    code, out, _ = await trellis(env, *gpu)
    assert code == 0, out
    code, _, err = await trellis(env, *gpu)
    assert code == 1 and "error [quota]" in err and "holds 1 gpu" in err, err

    code, out, _ = await trellis(env, "quota", "set", "acme", "memory", "--gib", "512")
    assert code == 0 and "quota of acme for memory: 512 GiB; holds 0 slices, 0 GiB" in out, out
    code, out, _ = await trellis(env, "quota", "show")
    assert code == 0, out
    lines = out.splitlines()
    assert any(line.split()[:4] == ["acme", "gpu", "1", "device"] for line in lines), out
    assert any(line.split()[:4] == ["acme", "memory", "512", "GiB"] for line in lines), out
    code, out, _ = await trellis(env, "quota", "show", "--view", "globex")
    assert code == 0 and "acme" not in out and "0 tenant and kind pairs" in out, out
    # The tenant as quota set takes it, positional (the day-2 probe: a usage error).
    assert await trellis(env, "quota", "show", "acme") == await trellis(
        env, "quota", "show", "--tenant", "acme"
    )

    code, _, err = await trellis(env, "quota", "set", "acme", "gpu", "--gib", "8")
    assert code == 1 and "error [invalid]" in err and "memory only" in err, err

    code, out, _ = await trellis(env, "quota", "clear", "acme", "gpu")
    assert code == 0 and "quota of acme for gpu: none (no limit); holds 1 device" in out, out
    code, out, _ = await trellis(env, *gpu)
    assert code == 0, out


async def test_an_operator_previews_reserves_lists_applies_and_cancels(
    h: Harness, env: dict[str, str]
) -> None:
    code, out, _ = await trellis(env, "topology", "import", str(EXAMPLE))
    assert code == 0, out

    code, out, _ = await trellis(env, "preview", "--host", "host-01", "--gpu", "1")
    assert code == 0 and "a compose now would take, on host-01" in out
    previewed = out.splitlines()[-1].split()[0]  # the one device row's id
    code, out, _ = await trellis(
        env, "reserve", "--host", "host-01", "--gpu", "1", "--tenant", "acme",
        "--duration", "600", "--json",
    )  # fmt: skip
    assert code == 0, out
    made = json.loads(out)
    rid = made["reservation_id"]
    assert [d["id"] for d in made["devices"]] == [previewed]

    code, out, _ = await trellis(env, "reservation", "list")
    assert code == 0 and rid in out and "acme" in out and previewed in out
    code, out, _ = await trellis(env, "reservation", "list", "--view", "globex")
    assert code == 0 and rid not in out
    code, out, _ = await trellis(env, "free", "--kind", "gpu")
    assert code == 0 and previewed not in out

    # Asked as the default tenant, acme's reservation is not found (§3); the CLI says who asked.
    code, _, err = await trellis(env, "apply", rid)
    assert code == 1 and "not_found" in err and "asked as tenant 'default'" in err, err
    # An unknown host or domain is unknown whoever asks: no tenant hint.
    for wrong in (["compose", "--host", "no-such-host", "--gpu", "1"],
                  ["apply", rid, "--domain", "no-such-domain"]):  # fmt: skip
        code, _, err = await trellis(env, *wrong)
        assert code == 1 and "not_found" in err and "asked as tenant" not in err, (wrong, err)
    code, out, _ = await trellis(env, "apply", rid, "--tenant", "acme")
    assert code == 0 and "active" in out and previewed in out
    code, _, err = await trellis(env, "apply", rid, "--tenant", "acme")
    assert code == 1 and "conflict" in err and "applied already" in err

    code, out, _ = await trellis(env, "reserve", "--host", "host-01", "--nic", "1", "--json")
    assert code == 0, out
    other = json.loads(out)["reservation_id"]
    code, out, _ = await trellis(env, "reservation", "cancel", other)
    assert code == 0 and f"reservation {other} cancelled" in out


async def test_rebuilding_the_projections_gives_the_same_answers(
    h: Harness, env: dict[str, str]
) -> None:
    await trellis(env, "topology", "import", str(EXAMPLE))
    await trellis(env, "compose", "--host", "host-02", "--gpu", "1", "--nic", "1")
    _, before, _ = await trellis(env, "connections", "--json")

    code, out, _ = await trellis(env, "projections", "rebuild")
    assert code == 0 and "rebuilt" in out

    _, after, _ = await trellis(env, "connections", "--json")
    rows = json.loads(before)["connections"]
    assert rows and json.loads(after)["connections"] == rows


async def test_fabric_show_asks_the_engine_not_a_local_file(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    """The engine's driver answers (the `fabric` query), whatever the CLI's own data dir holds:
    here a state file of other hardware, as on another host or in docker-compose."""
    elsewhere = SimulatedFabric(state_file=tmp_path / "cli-host" / "fabric.json")
    await elsewhere.bind(DOMAIN, STRAY)
    env = {**env, "TRELLIS_FABRIC_STATE": str(elsewhere.state_file)}
    fabric = SimulatedFabric(state_file=tmp_path / "engine-host" / "fabric.json")
    async with serving(nats_url, database_url, pg_schema, subject_prefix, fabric=fabric) as h:
        await trellis(env, "topology", "import", str(EXAMPLE))
        code, out, _ = await trellis(
            env, "compose", "--host", "host-01", "--memory", "512", "--tenant", "acme", "--json"
        )
        assert code == 0, out
        cid = json.loads(out)["composition_id"]
        await h.fabric_idle(DOMAIN)

        code, out, err = await trellis(env, "fabric", "show")
        assert code == 0, err
        assert "ocs-1" in out and cid in out and "mem-01 512 GiB" in out and "nic-01" not in out
        assert f"domain {DOMAIN} holds 1 circuit, 1 binding; in step with the log" in out
        code, out, _ = await trellis(env, "fabric", "show", "-o", "json")
        shown = json.loads(out)
        held = msgspec.to_builtins(await fabric.snapshot(DOMAIN))
        assert {k: shown[k] for k in ("circuits", "bindings", "findings")} == held
        assert (shown["domain"], shown["in_step"]) == (DOMAIN, True), shown

        await trellis(env, "release", cid, "--tenant", "acme")
        await h.fabric_idle(DOMAIN)
        code, out, _ = await trellis(env, "fabric", "show")
        assert code == 0 and f"the hardware of domain {DOMAIN} holds nothing" in out, out
    code, _, err = await trellis(env, "fabric", "show", "--timeout", "2")
    assert code == 3 and err.startswith("trellis: unavailable: no engine serves"), err


STRAY = FabricBinding(
    host="host-02", device="nic-01", path=["host-02", "nic-01"], composition_id="c-x"
)


async def test_fabric_check_tells_whether_the_hardware_holds_what_the_log_says(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    env: dict[str, str],
    tmp_path: Path,
) -> None:
    state_file = tmp_path / "engine-host" / "fabric.json"
    fabric = SimulatedFabric(state_file=state_file)
    async with serving(nats_url, database_url, pg_schema, subject_prefix, fabric=fabric) as h:
        await trellis(env, "topology", "import", str(EXAMPLE))
        code, out, _ = await trellis(env, "compose", "--host", "host-01", "--memory", "512")
        assert code == 0, out
        await h.fabric_idle(DOMAIN)

        code, out, err = await trellis(env, "fabric", "check")
        assert (code, out) == (0, f"{DOMAIN}: hardware holds what the log says\n"), err

        # While the engine idles, someone changes the hardware behind its back.
        tampered = SimulatedFabric(state_file=state_file)
        [bound] = (await tampered.snapshot(DOMAIN)).bindings
        await tampered.unbind(DOMAIN, bound)
        await tampered.bind(DOMAIN, STRAY)

        code, out, _ = await trellis(env, "fabric", "check")
        assert code == 1
        assert f"{DOMAIN}: hardware and log differ" in out
        assert (
            "holds nic-01 bound to host-02 for c-x over host-02 > nic-01, which the log does not"
            in out
        )
        assert f"lacks mem-01 bound to host-01 for {bound.composition_id}" in out
        code, out, _ = await trellis(env, "fabric", "check", "-o", "json")
        assert code == 1
        differences = json.loads(out)["differences"]
        assert differences["unbind"] == [msgspec.to_builtins(STRAY)], differences
        assert differences["bind"] == [msgspec.to_builtins(bound)], differences
        code, out, _ = await trellis(env, "fabric", "show", "-o", "wide")
        stray_row = next(line for line in out.splitlines() if "nic-01" in line)
        assert stray_row.endswith("not in the log"), out


async def test_without_a_reachable_engine_the_cli_says_so_in_one_line(
    env: dict[str, str],
) -> None:
    lonely = {**env, "TRELLIS_NATS_URL": "nats://127.0.0.1:1"}
    code, _, err = await trellis(lonely, "topology", "show", "--timeout", "2")
    assert code == 3  # EXIT_UNAVAILABLE
    assert err.startswith("trellis: unavailable: cannot reach NATS") and "Traceback" not in err


async def test_an_operator_drains_faults_adds_and_removes_from_the_cli(
    h: Harness, env: dict[str, str], tmp_path: Path
) -> None:
    """Every admin verb has a command (issue 12 item 4): the operator needs no `nats req`."""
    code, _, err = await trellis(env, "topology", "import", str(EXAMPLE))
    assert code == 0, err
    code, out, err = await trellis(env, "drain", "gpu-001", "--reason", "firmware")
    assert code == 0 and "gpu-001: healthy, drained" in out and "at position" in out, err
    code, out, _ = await trellis(env, "drain", "gpu-001")
    assert code == 0 and "already so, nothing changed" in out
    code, out, err = await trellis(env, "undrain", "gpu-001")
    assert code == 0 and "gpu-001: healthy" in out and "drained" not in out, err
    code, out, err = await trellis(
        env, "report-fault", "ocs-1:4", "--state", "degraded", "--detail", "CRC errors"
    )
    assert code == 0 and "ocs-1:4 (link " in out and ": degraded" in out, (out, err)
    code, out, err = await trellis(env, "report-fault", "ocs-1:4", "healthy")  # positional too
    assert code == 0 and ": healthy" in out, (out, err)
    node = tmp_path / "node.json"
    node.write_text(json.dumps({"id": "gpu-100", "kind": "device", "device_kind": "gpu"}))
    code, out, err = await trellis(env, "add-node", str(node), "--reason", "racked")
    assert code == 0 and "gpu-100: added" in out, err
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"id": "l-100", "a": "sw-r1", "b": "gpu-100", "capacity_gbps": 64}))
    code, out, err = await trellis(env, "add-link", str(link))
    assert code == 0 and "l-100: added" in out, err
    code, out, _ = await trellis(env, "topology", "show")
    assert code == 0 and "gpu-100" in out and "l-100" in out
    code, out, err = await trellis(env, "remove", "gpu-100", "--reason", "returned")
    # The node went, and the link that reached it with it (the answer's health is only its
    # default for a removed component: the summary said "gpu-100: healthy").
    assert code == 0 and "gpu-100: removed\nremoved with it: l-100" in out, (out, err)
    code, out, err = await trellis(env, "remove", "gpu-100")
    assert code == 1 and "error [not_found]" in err, (out, err)
    # What the log says happened, each with the operator as its actor.
    code, out, _ = await trellis(env, "why", "gpu-001")
    assert code == 0 and "ComponentDrained" in out and "ComponentUndrained" in out, out


async def test_the_cli_names_its_version_and_the_last_migration_it_carries(
    env: dict[str, str],
) -> None:
    code, out, _ = await trellis(env, "--version")
    last = migration_files()[-1][0]
    assert code == 0 and out.startswith("trellis ") and out.split()[1][0].isdigit(), out
    assert out.rstrip().endswith(f"(schema {last:03d})"), out


async def test_compositions_are_listed_and_shown_and_events_watched_from_the_cli(
    h: Harness, env: dict[str, str]
) -> None:
    """`composition get` / `list` and `watch` (issue 12 item 4), against a running engine."""
    code, _, err = await trellis(env, "topology", "import", str(EXAMPLE))
    assert code == 0, err
    watching = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.cli", "watch", "--count", "2",
        "--type", "CompositionActivated", "--type", "CompositionReleased", "--tenant", "acme",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    until_ctrl_c = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trellis.adapters.entrypoints.cli", "watch",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await asyncio.sleep(1.5)  # the watcher subscribes before the events it should see
    ids = []
    for tenant, host in (("acme", "host-01"), ("globex", "host-02")):
        code, out, err = await trellis(
            env, "compose", "--host", host, "--gpu", "1", "--tenant", tenant, "--json"
        )
        assert code == 0, err
        ids.append(json.loads(out)["composition_id"])
    code, out, err = await trellis(env, "composition", "get", ids[0])
    assert code == 0 and f"composition {ids[0]} on host-01: active" in out, err
    # The KV feed follows the log a moment behind the replies.
    for _ in range(50):
        code, out, err = await trellis(env, "composition", "list")
        if ids[0] in out and ids[1] in out:
            break
        await asyncio.sleep(0.2)
    assert code == 0 and ids[0] in out and ids[1] in out, (out, err)
    code, out, _ = await trellis(env, "composition", "list", "--tenant", "globex")
    assert code == 0 and ids[1] in out and ids[0] not in out, out
    code, out, _ = await trellis(env, "composition", "list", "--host", "host-01", "--json")
    assert code == 0 and [r["id"] for r in json.loads(out)] == [ids[0]], out
    # `composition get` for people shows its conditions as the bucket holds them (kubectl
    # describe's); its JSON stays the query's result.
    code, out, err = await trellis(env, "composition", "get", ids[0])
    assert code == 0, err
    rows = [line.split()[:3] for line in out.splitlines()]
    assert ["condition", "status", "reason"] in rows, out
    assert ["Bound", "True", "DevicesReserved"] in rows and ["Ready", "True", "Activated"] in rows
    code, out, _ = await trellis(env, "composition", "get", ids[0], "-o", "json")
    assert code == 0 and "conditions" not in json.loads(out), out
    for tenant, cid in zip(("acme", "globex"), ids, strict=True):
        code, _, err = await trellis(env, "release", cid, "--tenant", tenant)
        assert code == 0, err
    out_b, err_b = await asyncio.wait_for(watching.communicate(), 30)
    lines = out_b.decode().splitlines()
    assert watching.returncode == 0, err_b.decode()
    assert [line.split()[3] for line in lines] == [
        "CompositionActivated",
        "CompositionReleased",
    ], lines
    assert all(ids[0] in line for line in lines), lines  # acme's only
    # A watch "until Ctrl-C" ends as every command's Ctrl-C does: 130, nothing printed.
    until_ctrl_c.send_signal(signal.SIGINT)
    out_c, err_c = await asyncio.wait_for(until_ctrl_c.communicate(), 30)
    assert (until_ctrl_c.returncode, err_c.decode()) == (130, ""), out_c.decode()
    assert ids[1] in out_c.decode()  # it had followed globex's events too
    for _ in range(50):
        code, out, _ = await trellis(env, "composition", "list")
        if "no live compositions" in out:
            break
        await asyncio.sleep(0.2)
    assert code == 0 and "no live compositions" in out, out


async def test_the_shared_options_are_taken_before_the_command_too(
    h: Harness, env: dict[str, str]
) -> None:
    """`trellis -o json topology show`, as kubectl takes its global flags (it was a usage
    error); given on both sides, the one after the command wins."""
    await trellis(env, "topology", "import", str(EXAMPLE))
    result = (await h.client.query(DOMAIN, "topology", {}))["result"]
    code, out, err = await trellis(env, "-o", "json", "topology", "show")
    assert code == 0 and json.loads(out) == result, err
    code, out, err = await trellis(env, "--domain", DOMAIN, "--json", "topology", "show")
    assert code == 0 and json.loads(out) == result, err
    _, wide, _ = await trellis(env, "topology", "show", "-o", "wide")
    code, out, err = await trellis(env, "-o", "json", "topology", "show", "-o", "wide")
    assert code == 0 and out == wide and "labels" in out, (out, err)
    # The domain after the command wins over one before it that names no domain served.
    code, out, err = await trellis(
        env, "--domain", "nowhere", "topology", "show", "--domain", DOMAIN, "-o", "json"
    )
    assert code == 0 and json.loads(out) == result, err


async def test_results_print_as_a_table_as_json_or_wide(h: Harness, env: dict[str, str]) -> None:
    """`-o json` prints the reply's result exactly (`--json` too); `-o wide` adds columns the
    table leaves out; a refusal in json is the error reply, on stdout."""
    await trellis(env, "topology", "import", str(EXAMPLE))
    code, out, err = await trellis(
        env, "compose", "--host", "host-01", "--gpu", "1", "--memory", "256", "--tenant", "acme",
        "--reason", "decode", "-o", "json",
    )  # fmt: skip
    assert code == 0, err
    composed = json.loads(out)
    cid, gpu = composed["composition_id"], composed["devices"][0]["id"]
    await h.fabric_idle(DOMAIN)
    # (command, the query it asks, its body, what only -o wide shows)
    cases = [
        (["composition", "get", cid], "composition", {"id": cid}, "tenant: acme"),
        (["connections"], "connections", {}, "request"),
        (["free", "--kind", "gpu"], "free", {"kind": "gpu"}, "cost/h"),
        (["why", gpu], "why", {"id": gpu}, "full times"),
        (["history"], "history", {}, "from"),
        (["topology", "show"], "topology", {}, "labels"),
        (["fabric", "show"], "fabric", {}, "in the log"),
        (["quota", "show"], "quotas", {}, None),
        (["blast-radius", "sw-r1"], "blast-radius", {"id": "sw-r1"}, None),
    ]
    for args, what, body, wide_only in cases:
        code, out, err = await trellis(env, *args, "-o", "json")
        assert code == 0, (args, err)
        result = (await h.client.query(DOMAIN, what, body))["result"]
        assert json.loads(out) == result, args
        if wide_only is None:
            continue  # everything it has fits the table
        code, table, _ = await trellis(env, *args)
        code, wide, _ = await trellis(env, *args, "-o", "wide")
        assert code == 0 and table.split()[0] == wide.split()[0], (args, table, wide)
        if wide_only == "full times":
            wide_only = result["chain"][0]["time"]  # to the microsecond, with its zone
        assert wide_only in wide and wide_only not in table, (args, table, wide)
    _, as_json, _ = await trellis(env, "connections", "-o", "json")
    _, alias, _ = await trellis(env, "connections", "--json")
    assert alias == as_json and json.loads(alias)["connections"], alias

    code, out, err = await trellis(
        env, "compose", "--host", "host-01", "--gpu", "9", "--model", "B200", "-o", "json"
    )
    assert code == 1 and err == "", err
    refused = json.loads(out)
    assert refused["ok"] is False and refused["error"]["code"] == "no_capacity", refused
    assert refused["error"]["details"]["funnel"], refused
