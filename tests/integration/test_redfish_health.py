"""/healthz on the Redfish driver: a fabric manager that stops answering fails the `fabric`
check, naming the domain, the service and the error, within a few polls, and the log says so
once; once it answers again the check passes and the log says that once. Real NATS and
Postgres, DMTF's Mockup Server as the fabric manager, the engine as `trellis up` wires it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fabrics import expect_ok
from harness import serving
from mockup_server import MockupServer
from redfish_trees import write_tree

from trellis.adapters.fabric.redfish.client import RedfishClient
from trellis.adapters.fabric.redfish.discovery import discover
from trellis.adapters.fabric.redfish.driver import RedfishFabric

EXAMPLE = json.loads((Path(__file__).resolve().parents[2] / "examples/fabric.json").read_text())
POLL_S = 0.3


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def healthz(base: str) -> tuple[int, dict[str, Any]]:
    status, body = await asyncio.to_thread(_get, f"{base}/healthz")
    return status, json.loads(body)


async def reachable_gauge(base: str, domain: str) -> str:
    _, body = await asyncio.to_thread(_get, f"{base}/metrics")
    prefix = f'trellis_fabric_reachable{{domain="{domain}"}} '
    return next(line for line in body.decode().splitlines() if line.startswith(prefix)).split()[1]


async def until(what: str, check: Callable[[], Awaitable[bool]], within: float) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within} s: {what}")
        await asyncio.sleep(0.1)


async def test_an_unreachable_fabric_manager_fails_healthz_until_it_answers_again(
    tmp_path: Path,
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trellis.adapters.fabric.redfish.watch")
    domain = f"rf{uuid.uuid4().hex[:8]}"
    with MockupServer(write_tree(EXAMPLE, tmp_path / "tree")) as server:
        driver = RedfishFabric(RedfishClient(server.url, timeout=1.0), poll_s=POLL_S)
        async with serving(
            nats_url,
            database_url,
            pg_schema,
            subject_prefix,
            fabric=driver,
            metrics_at=("127.0.0.1", 0),
        ) as h:
            client = RedfishClient(server.url)
            document = (await discover(client)).document
            await client.close()
            expect_ok(await h.client.admin(domain, "import-topology", document))
            await h.fabric_idle(domain, timeout=30.0)
            assert h.metrics_url is not None and h.fabric_watch is not None
            base, watch = h.metrics_url, h.fabric_watch

            async def healthy() -> bool:
                status, body = await healthz(base)
                return status == 200 and body["checks"]["fabric"] is True

            await until("healthz ok with the fabric manager up", healthy, 10.0)
            assert await reachable_gauge(base, domain) == "1.0"

            server.stop()
            stopped = time.monotonic()
            seen: dict[str, Any] = {}

            async def failing() -> bool:
                status, body = await healthz(base)
                seen.update(body)
                return status == 503 and body["checks"]["fabric"] is False

            await until("healthz failing on the fabric", failing, 10 * POLL_S + 2.0)
            assert time.monotonic() - stopped < 10 * POLL_S + 2.0
            assert seen["status"] == "unavailable"
            # The fabric alone fails: the engine itself is fine.
            assert {k: v for k, v in seen["checks"].items() if not v} == {"fabric": False}
            [problem] = seen["problems"]
            assert problem.startswith(
                f"fabric of domain {domain}: fabric manager unreachable at {server.url} since "
            ), problem
            assert "GET /redfish/v1/" in problem, problem
            assert await reachable_gauge(base, domain) == "0.0"

            # Many polls while it is down, one warning.
            polls = watch.polls
            await until("five more polls", lambda: _true(watch.polls >= polls + 5), 10.0)
            down = [r for r in caplog.records if "unreachable at" in r.getMessage()]
            assert len(down) == 1, [r.getMessage() for r in down]
            assert down[0].levelno == logging.WARNING
            assert not [r for r in caplog.records if "no health from" in r.getMessage()]

            server.start()  # the same port
            await until("healthz ok again", healthy, 10 * POLL_S + 2.0)
            _, body = await healthz(base)
            assert body["problems"] == [], body
            assert await reachable_gauge(base, domain) == "1.0"
            back = [r for r in caplog.records if "reachable again" in r.getMessage()]
            assert len(back) == 1, [r.getMessage() for r in back]


async def _true(value: bool) -> bool:
    return value
