"""The `fabric` query (`<prefix>.query.<domain>.fabric`): the engine answers from its own fabric
driver, compared with the log (engine/service/fabric_report.py), over real NATS and Postgres."""

from __future__ import annotations

import asyncio

import msgspec
from fabrics import check_envelope, expect_error, expect_ok, fabric
from harness import serving

from trellis.adapters.fabric.sim import SimulatedFabric

DOMAIN = "fq"
COMPOSE = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["H100"]}]}


async def test_the_fabric_query_reports_a_running_saga_and_then_what_the_driver_holds(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    fabric_driver = SimulatedFabric(latency={"bind": 1.0})  # the saga is slow to bind
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, fabric=fabric_driver
    ) as h:
        expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
        composing = asyncio.create_task(h.client.intent(DOMAIN, "acme", "compose", COMPOSE))
        while True:  # the compose reply waits for its saga; the query does not
            during = expect_ok(await h.client.query(DOMAIN, "fabric"))
            if during["differences"]["pending"]:
                break
            assert not composing.done(), await composing
            await asyncio.sleep(0.05)
        composed = expect_ok(await composing)
        assert during["differences"]["pending"] == [composed["composition_id"]], during
        # A pending composition's circuits and bindings are its saga's, not differences.
        assert during["settling"] is True and during["in_step"] is True, during

        await h.fabric_idle(DOMAIN)
        reply = await h.client.query(DOMAIN, "fabric", {"min_position": 1})
        check_envelope(reply)
        after = expect_ok(reply)
        held = msgspec.to_builtins(await fabric_driver.snapshot(DOMAIN))
        assert {k: after[k] for k in ("circuits", "bindings", "findings")} == held
        assert [b["composition_id"] for b in after["bindings"]] == [composed["composition_id"]]
        assert after["domain"] == DOMAIN and after["in_step"] is True, after
        assert after["settling"] is False and after["differences"] == {
            "unbind": [], "remove": [], "create": [], "bind": [], "pending": []
        }  # fmt: skip
        assert reply["position"] == (await h.store.head(DOMAIN)).position


async def test_the_fabric_query_refuses_what_it_cannot_answer_with_typed_errors(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> None:
    fabric_driver = SimulatedFabric()
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, fabric=fabric_driver, saga_deadline=1.0
    ) as h:
        expect_ok(await h.client.admin(DOMAIN, "import-topology", fabric()))
        await h.fabric_idle(DOMAIN)

        error = expect_error(await h.client.query(DOMAIN, "fabric", {"at": 1}), "invalid")
        assert "for now only" in error["message"], error
        error = expect_error(await h.client.view(DOMAIN, "acme", "fabric"), "invalid")
        assert "no tenant view" in error["message"], error
        expect_error(await h.client.query("nowhere", "fabric"), "not_found")
        expect_error(await h.client.query(DOMAIN, "fabric", {"colour": "red"}), "invalid")

        fabric_driver.fail_next("snapshot")
        error = expect_error(await h.client.query(DOMAIN, "fabric"), "unavailable")
        assert error["details"]["step"] == "snapshot", error
        fabric_driver.hang_next("snapshot")
        error = expect_error(await h.client.query(DOMAIN, "fabric"), "unavailable")
        assert "did not answer within 1 s" in error["message"], error
        # Nothing changed: the next read answers.
        assert expect_ok(await h.client.query(DOMAIN, "fabric"))["in_step"] is True
