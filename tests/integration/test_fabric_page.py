"""The live fabric page (`trellis up --http`), in a real headless browser against a real engine.

Debian's chromium (`apt-get install -y chromium`) is driven by Playwright's Python package with
`executable_path`; Playwright's own browsers are never downloaded. The page is loaded once and
never reloaded: a compose and a fault sent over NATS reach it through the KV bucket and the
event feed (server-sent events), and a click asks the engine's `why` through the page's server.
A small `trellis demo economics` run is watched on pages opened before its domains existed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from engines import Fleet
from fabrics import expect_ok
from harness import Harness, run_cli, serving
from test_secure_mode import first_snapshot

from trellis.adapters.entrypoints.economics import demo
from trellis.adapters.entrypoints.economics.data import read_hall
from trellis.adapters.entrypoints.economics.runs import Plan
from trellis.adapters.http import fabric_page
from trellis.adapters.http.fabric_page import FabricPage
from trellis.adapters.nats.client import TrellisClient
from trellis.adapters.nats.connect import connect_nats

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
try:
    from playwright.async_api import Browser, Page, async_playwright, expect
except ImportError:  # the dev extra is not installed
    async_playwright = None  # type: ignore[assignment]

pytestmark = pytest.mark.skipif(
    async_playwright is None or not os.access(CHROMIUM, os.X_OK),
    reason="needs Debian's chromium and Playwright's Python package: "
    "`apt-get install -y chromium` and `pip install -e '.[dev]'` (no `playwright install`)",
)

DOMAIN = "hall-1"
FABRIC = json.loads((Path(__file__).parents[2] / "examples" / "fabric.json").read_text())
H100 = {"host": "host-01", "devices": [{"kind": "gpu", "models": ["H100"]}], "reason": "demo"}
WAIT_MS = 30_000  # how long the browser waits for the page to show something, on a busy box
RED = "rgb(214, 40, 40)"  # page.css: a failed node's fill
SAME_COLOUR = """([device, composition]) => {
  const swatch = document.querySelector(`#compositions [data-id="${composition}"] .swatch`);
  const circle = document.querySelector(`#fabric [data-id="${device}"] circle`);
  if (!swatch || !circle) return false;
  const colour = getComputedStyle(swatch).backgroundColor;
  return colour !== "" && colour === getComputedStyle(circle).fill;
}"""
# The drawing's size, the room it has, and which nodes' shapes overlap another's.
DRAWING = """() => {
  const svg = document.querySelector("#fabric"), box = svg.getBoundingClientRect();
  const shapes = [...svg.querySelectorAll(".node")]
    .map((g) => [g.dataset.id, g.firstChild.getBoundingClientRect()]);
  const overlaps = [];
  shapes.forEach(([a, p], i) => shapes.slice(i + 1).forEach(([b, q]) => {
    const apart = p.right <= q.left || q.right <= p.left || p.bottom <= q.top || q.bottom <= p.top;
    if (!apart) overlaps.push(`${a}/${b}`);
  }));
  const room = svg.parentElement.clientWidth;
  return { width: box.width, height: box.height, room, nodes: shapes.length, overlaps };
}"""


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Debian's chromium, headless, closed however the test ends."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield browser
        finally:
            await browser.close()


async def new_tab(browser: Browser, width: int = 1400) -> Page:
    tab = await browser.new_page(viewport={"width": width, "height": 900})
    tab.set_default_timeout(WAIT_MS)
    return tab


@asynccontextmanager
async def one_tab() -> AsyncIterator[Page]:
    async with chromium() as browser:
        yield await new_tab(browser)


@pytest_asyncio.fixture
async def h(
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str
) -> AsyncIterator[Harness]:
    async with serving(
        nats_url, database_url, pg_schema, subject_prefix, page_at=("127.0.0.1", 0)
    ) as harness:
        yield harness


@pytest_asyncio.fixture
async def page(h: Harness) -> AsyncIterator[Page]:
    """A headless chromium tab on the fabric page, the fabric imported before it opens."""
    expect_ok(await h.client.admin(DOMAIN, "import-topology", FABRIC))
    await h.relayed(DOMAIN)
    assert h.page_url is not None
    async with one_tab() as tab:
        await tab.goto(f"{h.page_url}/")
        yield tab


def node(page: Page, node_id: str) -> Any:
    return page.locator(f'#fabric [data-id="{node_id}"]')


async def test_the_page_shows_the_fabric_and_follows_it_live(
    h: Harness, page: Page, tmp_path: Path
) -> None:
    # The graph: every host, switch, OCS and device of the imported fabric, and every link.
    for spec in FABRIC["nodes"]:
        await expect(node(page, spec["id"])).to_have_class(re.compile(f"kind-{spec['kind']}"))
    await expect(page.locator("#fabric [data-link]")).to_have_count(len(FABRIC["links"]))
    await expect(page.locator("#status")).to_have_text("live")
    drawn = await page.evaluate(DRAWING)
    assert drawn["nodes"] == len(FABRIC["nodes"]) and not drawn["overlaps"], drawn
    assert drawn["height"] < 600 and drawn["width"] <= drawn["room"], drawn
    await page.evaluate("window.loadedOnce = true")  # gone if the page ever reloads

    # A compose over NATS appears, coloured by its tenant, with the path it holds.
    composed = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100))
    cid, (device,) = composed["composition_id"], composed["devices"]
    listed = page.locator(f'#compositions [data-id="{cid}"]')
    await expect(listed).to_have_attribute("data-tenant", "acme")
    await expect(listed).to_contain_text(device["id"])
    held = page.locator(f'#fabric .held[data-composition="{cid}"]')
    await expect(held).to_have_count(len(device["path"]) - 1)  # one line per hop
    # The device is filled with the tenant's colour, the composition's swatch in the list.
    await page.wait_for_function(SAME_COLOUR, arg=[device["id"], cid])

    # A fault turns its component red, and the faults list names it.
    faulty = "gpu-007"
    report = {"component": faulty, "state": "failed", "detail": "xid 79"}
    expect_ok(await h.client.admin(DOMAIN, "report-fault", report))
    await expect(node(page, faulty)).to_have_class(re.compile("health-failed"))
    # Asked again until it holds: each update draws the graph anew, and a circle read as it is
    # replaced has no style at all ("").
    await expect(node(page, faulty).locator("circle")).to_have_css("fill", RED)
    await expect(page.locator(f'#faults [data-id="{faulty}"]')).to_contain_text("xid 79")

    # A click on a device, then on the composition, shows the engine's own `why` of it.
    for clicked, target in ((device["id"], node(page, device["id"])), (cid, listed)):
        await target.click()
        said = expect_ok(await h.client.query(DOMAIN, "why", {"id": clicked}))["text"]
        await expect(page.locator(f'#why .text[data-id="{clicked}"]')).to_have_text(said)

    # The utilization chart has sampled the held GPU.
    await expect(page.locator("#utilization")).to_have_attribute("data-gpus-held", "1")
    assert await page.evaluate("window.loadedOnce") is True, "the page reloaded"
    shot = tmp_path / "fabric-page.png"
    await page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")


async def test_an_economics_run_shows_on_pages_opened_before_its_domains(
    h: Harness, nats_url: str, subject_prefix: str, tmp_path: Path
) -> None:
    # Two pages open on an engine with no domain yet: the URL the demo prints (its first run's
    # domain, imported just after) and the bare page, which picks a domain once one appears.
    stamp = "page"
    pooled, fixed = (demo.domain_of(run, stamp) for run in demo.RUNS)
    assert h.page_url is not None
    printed = demo.watch(h.page_url, stamp).split()[2]
    assert printed == f"{h.page_url}/?domain={pooled}", printed
    nc = await connect_nats(nats_url, name="test-page-economics")
    client = TrellisClient(nc, prefix=subject_prefix)
    plan = Plan(seconds=5, requests=8)
    run: asyncio.Task[demo.Outcome] | None = None
    async with chromium() as browser:
        try:
            tabs = []
            for url in (printed, f"{h.page_url}/"):
                tab = await new_tab(browser, width=1280)
                await tab.goto(url)
                await expect(tab.locator("#status")).to_have_text("live")
                tabs.append(tab)
            watching, bare = tabs
            await expect(watching.locator("#empty")).to_be_visible()
            run = asyncio.create_task(demo.economics(client, h.store, plan, stamp=stamp))

            # The watched domain's hall arrives, then the pooled run's compositions on it.
            await expect(node(watching, "host-r1-1")).to_have_class(re.compile("kind-host"))
            listed = watching.locator("#compositions li.composition")
            await expect(listed.first).to_have_attribute("data-tenant", "pooled")
            await expect(watching.locator("#fabric .held").first).to_be_attached()
            # The hall's 211 nodes laid out by rack, none over another, in under two screens
            # at 1280 px (in one column they took ~5,800 px) and no wider than the page.
            drawn, hall = await watching.evaluate(DRAWING), read_hall(plan.hall)
            assert drawn["nodes"] == len(hall["nodes"]) and not drawn["overlaps"], drawn
            assert drawn["height"] < 2500 and drawn["width"] <= drawn["room"], drawn
            shot = tmp_path / "fabric-page-economics.png"
            await watching.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            # The bare page lists both runs' domains; picked there, the fixed run's boxes show
            # once it starts (after the pooled run and its leases' end, ~15 s).
            await expect(bare.locator("#domain option")).to_have_text([fixed, pooled])
            await bare.select_option("#domain", fixed)
            boxes = bare.locator("#compositions li.composition")
            await expect(boxes.first).to_have_attribute("data-tenant", "fixed", timeout=60_000)

            outcome = await asyncio.wait_for(run, 90)
            assert outcome.figures["pooled"].served > 0
            # Every lease ran out before the run ended: both pages show nothing held.
            await expect(listed).to_have_count(0)
            await expect(boxes).to_have_count(0)
        finally:
            if run is not None and not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
            await nc.close()


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


async def test_the_page_server_refuses_what_it_does_not_serve(h: Harness) -> None:
    assert h.page_url is not None and h.page_url.startswith("http://127.0.0.1:")
    status, kind, body = await asyncio.to_thread(get, f"{h.page_url}/api/why?domain=hall-1&id=a.b")
    assert (status, kind) == (400, "application/json"), body
    assert json.loads(body)["error"]["code"] == "invalid"
    status, _, body = await asyncio.to_thread(get, f"{h.page_url}/api/topology?domain=no%20such")
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid"
    # A domain nobody imported: the engine's own answer, passed on as is.
    status, _, body = await asyncio.to_thread(get, f"{h.page_url}/api/topology?domain=nowhere")
    assert status == 200 and json.loads(body)["error"]["code"] == "not_found", body
    status, _, _ = await asyncio.to_thread(get, f"{h.page_url}/nothing-here")
    assert status == 404
    status, kind, body = await asyncio.to_thread(get, f"{h.page_url}/page.js")
    assert status == 200 and kind.startswith("text/javascript") and b"EventSource" in body


async def test_trellis_up_prints_the_page_url_and_serves_it(  # TRELLIS_HTTP_PORT=0
    nats_url: str, database_url: str, pg_schema: str, subject_prefix: str, tmp_path: Path
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRELLIS_")},
        "TRELLIS_NATS_URL": nats_url,
        "TRELLIS_DATABASE_URL": database_url,
        "TRELLIS_DB_SCHEMA": pg_schema,
        "TRELLIS_SUBJECT_PREFIX": subject_prefix,
        "TRELLIS_DATA_DIR": str(tmp_path / "data"),
        "TRELLIS_HTTP_PORT": "0",
    }
    fleet = Fleet(env, tmp_path, DOMAIN)
    try:
        engine = await fleet.start_one()
        printed = re.search(r"fabric page: (http://127\.0\.0\.1:\d+)/ ", engine.said())
        assert printed is not None, engine.said()
        status, kind, body = await asyncio.to_thread(get, f"{printed[1]}/")
        assert status == 200 and kind.startswith("text/html") and b"page.js" in body
    finally:
        await fleet.stop()
    code, _, err = await run_cli(env, "up", "--http", "http")
    assert code == 2 and err.startswith("trellis: usage: ") and "--http" in err, err


# The palette's colours as RGB, and the smallest CIE76 distance between any two of them.
COLOURS = """(tenants) => tenants.map((t) => tenantColour(t))"""


def lab(hex_colour: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of an sRGB colour."""
    rgb = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    x = (0.4124 * lin[0] + 0.3576 * lin[1] + 0.1805 * lin[2]) / 0.95047
    y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    z = (0.0193 * lin[0] + 0.1192 * lin[1] + 0.9505 * lin[2]) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


async def test_sixteen_tenants_get_sixteen_colours_far_apart(page: Page) -> None:
    # Names that hash close together, as tenant-a and tenant-b once did (1 degree apart).
    tenants = [f"tenant-{chr(ord('a') + i)}" for i in range(16)]
    colours = await page.evaluate(COLOURS, tenants)
    assert len(set(colours)) == 16, colours
    again = await page.evaluate(COLOURS, tenants)
    assert again == colours  # a tenant keeps its colour
    points = [lab(c) for c in colours]
    closest = min(
        sum((a - b) ** 2 for a, b in zip(p, q, strict=True)) ** 0.5
        for i, p in enumerate(points)
        for q in points[i + 1 :]
    )
    assert closest > 30, closest  # CIE76: about 2.3 is a just-noticeable difference
    fault = lab("#d62828")  # page.css: failed nodes
    assert min(sum((a - b) ** 2 for a, b in zip(p, fault, strict=True)) ** 0.5 for p in points) > 30


def cable(id: str, a: str, b: str) -> dict[str, Any]:
    return {"id": id, "a": a, "b": b, "capacity_gbps": 64, "latency_ns": 1}


async def test_a_chain_of_4000_switches_is_drawn_not_blank(h: Harness) -> None:
    switches = [f"sw-{i:04}" for i in range(4000)]
    chain = {
        "nodes": [
            {"id": "host-01", "kind": "host"},
            *({"id": s, "kind": "switch", "latency_ns": 10} for s in switches),
            {"id": "gpu-end", "kind": "device", "device_kind": "gpu", "model": "H100"},
        ],
        "links": [
            cable("l-host", "host-01", switches[0]),
            *(cable(f"l-{i:04}", a, b) for i, (a, b) in enumerate(itertools.pairwise(switches))),
            cable("l-end", switches[-1], "gpu-end"),
        ],
    }
    expect_ok(await h.client.admin("chain", "import-topology", chain))
    await h.relayed("chain")
    assert h.page_url is not None
    async with one_tab() as tab:
        await tab.goto(f"{h.page_url}/?domain=chain")
        await expect(node(tab, "gpu-end")).to_have_count(1)
        await expect(node(tab, switches[-1])).to_have_count(1)
        assert await tab.locator("#problem").is_hidden()


async def test_what_the_page_cannot_draw_is_said_in_a_banner_and_the_rest_goes_on(
    h: Harness, page: Page
) -> None:
    await expect(node(page, "host-01")).to_have_count(1)
    await expect(page.locator("#problem")).to_be_hidden()
    # A topology the drawing cannot take (what a bug or a foreign answer would bring).
    await page.evaluate("() => { state.topology = { nodes: null, links: 7 }; later(relayout, 0); }")
    await expect(page.locator("#problem")).to_be_visible()
    await expect(page.locator("#problem")).to_contain_text("drawing (relayout)")
    # Drawn again from the engine's topology, the part works again and its banner goes.
    await page.evaluate("() => refreshTopology()")
    await expect(page.locator("#problem")).to_be_hidden()
    await expect(node(page, "host-01")).to_have_count(1)
    await page.evaluate("() => { state.topology = { nodes: null, links: 7 }; later(relayout, 0); }")
    await expect(page.locator("#problem")).to_be_visible()
    # The live feed and the lists keep working.
    composed = expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100))
    listed = page.locator(f'#compositions [data-id="{composed["composition_id"]}"]')
    await expect(listed).to_have_attribute("data-tenant", "acme")


async def test_a_page_opened_on_a_busy_log_shows_its_recent_events(
    h: Harness, nats_url: str, subject_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expect_ok(await h.client.admin(DOMAIN, "import-topology", FABRIC))
    expect_ok(await h.client.intent(DOMAIN, "acme", "compose", H100))
    head = await h.relayed(DOMAIN)
    assert h.page_url is not None

    def positions(url: str) -> list[int]:
        events = first_snapshot(url)["events"].get(DOMAIN, [])
        assert all(e["domain"] == DOMAIN for e in events), events
        return [e["position"] for e in events]

    # The running page kept the events it followed; a new page gets them in its snapshot.
    while (await asyncio.to_thread(positions, h.page_url))[-1:] != [head]:
        await asyncio.sleep(0.1)
    assert await asyncio.to_thread(positions, h.page_url) == list(range(1, head + 1))
    # A page server started after them reads the stream's last ones, and keeps a bounded few.
    monkeypatch.setattr(fabric_page, "RECENT_EVENTS", 2)
    nc = await connect_nats(nats_url, name="test-page-recent")
    later = FabricPage(nc, prefix=subject_prefix)
    try:
        await later.start()
        while await asyncio.to_thread(positions, later.url) != [head - 1, head]:
            await asyncio.sleep(0.1)
    finally:
        await later.close()
        await nc.close()

    # In the browser: the feed lists them as soon as the page opens.
    async with one_tab() as tab:
        await tab.goto(f"{h.page_url}/?domain={DOMAIN}")
        await expect(tab.locator("#feed li")).to_have_count(head)
        await expect(tab.locator("#feed li").last).to_contain_text("#1 TopologyImported")


async def test_after_an_engine_restart_a_secure_page_says_it_needs_the_new_address(
    h: Harness, nats_url: str, subject_prefix: str
) -> None:
    # What a restart of `trellis up --secure` is to an open page: the same address, served
    # again with a new token, so the browser's cookie is refused (401).
    nc = await connect_nats(nats_url, name="test-page-restart")
    before = FabricPage(nc, prefix=subject_prefix, token="token-before")
    await before.start()
    url, port = before.url, int(before.url.rsplit(":", 1)[1])
    after = FabricPage(nc, prefix=subject_prefix, port=port, token="token-after")
    try:
        async with one_tab() as tab:
            await tab.goto(f"{url}/?token=token-before")
            await expect(tab.locator("#status")).to_have_text("live")
            await before.close()
            await after.start()
            await expect(tab.locator("#status")).to_have_text("engine restarted")
            banner = tab.locator("#problem")
            await expect(banner).to_be_visible()
            await expect(banner).to_contain_text("the engine restarted")
            await expect(banner).to_contain_text("the new address `trellis up` printed")
    finally:
        await before.close()
        await after.close()
        await nc.close()


async def test_a_domain_that_does_not_exist_yet_is_a_note_not_a_problem(h: Harness) -> None:
    assert h.page_url is not None
    async with one_tab() as tab:
        async with tab.expect_response(re.compile(r"/api/topology\?domain=later2$")) as asked:
            await tab.goto(f"{h.page_url}/?domain=later2")
        assert (await (await asked.value).json())["error"]["code"] == "not_found"
        await expect(tab.locator("#empty")).to_be_visible()
        await expect(tab.locator("#status")).to_have_text("live")
        assert await tab.locator("#problem").is_hidden()
        expect_ok(await h.client.admin("later2", "import-topology", FABRIC))
        await expect(node(tab, "host-01")).to_have_count(1)
        await expect(tab.locator("#empty")).to_be_hidden()
        assert await tab.locator("#problem").is_hidden()


async def test_a_failed_link_is_drawn_over_the_paths_held_along_it(h: Harness, page: Page) -> None:
    for model in ("A100", "H100", "H200"):  # gpu-001..003: paths down sw-r1's spine
        wanted = {**H100, "devices": [{"kind": "gpu", "models": [model]}]}
        expect_ok(await h.client.intent(DOMAIN, "acme", "compose", wanted))
    await expect(page.locator("#compositions li.composition")).to_have_count(3)
    report = {"component": "l-005", "state": "failed", "detail": "cable-cut"}
    expect_ok(await h.client.admin(DOMAIN, "report-fault", report))
    failed = page.locator('#fabric [data-link="l-005"]')
    await expect(failed).to_have_class(re.compile("health-failed"))
    await expect(failed).to_have_css("stroke", RED)
    # SVG paints in document order: the failed link comes after (over) every held path.
    over = """() => {
      const failed = document.querySelector('#fabric [data-link="l-005"]');
      return [...document.querySelectorAll("#fabric .held")].every(
        (held) => held.compareDocumentPosition(failed) & Node.DOCUMENT_POSITION_FOLLOWING);
    }"""
    assert await page.evaluate(over) is True


async def test_the_page_loads_without_a_failed_request(h: Harness) -> None:
    assert h.page_url is not None
    async with one_tab() as tab:
        failed: list[str] = []
        tab.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
        tab.on("console", lambda m: failed.append(m.text) if m.type == "error" else None)
        await tab.goto(f"{h.page_url}/")
        await expect(tab.locator("#status")).to_have_text("live")
        await tab.wait_for_load_state("networkidle")
        assert failed == []
