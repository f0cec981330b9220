"""DMTF's validators against a live Trellis holding compositions (ARCHITECTURE §11, Gates):
the Service Validator crawls every resource and must report 0 failures; the Protocol Validator
runs, and each assertion it still fails must be one docs/redfish.md names with why.

Both run offline: the schemas come from third_party/dmtf/redfish-csdl/ (`--skipschema`).
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import re
import shutil
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from harness import Harness, serving
from redfish_http import RedfishHttp

from trellis.adapters.http.redfish.serve import RedfishOptions

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
CSDL = ROOT / "third_party" / "dmtf" / "redfish-csdl" / "csdl"
DOMAIN = "hall-1"
FABRIC = json.loads((ROOT / "examples" / "fabric.json").read_text())
ADMIN_PASSWORD = "admin-secret-1"
R = "/redfish/v1"
BLOCKS = f"{R}/CompositionService/ResourceBlocks"


def _tool(name: str) -> str:
    found = Path(sys.executable).parent / name
    if not found.exists():
        pytest.skip(f"{name} is not installed: pip install -e '.[dev]' (the redfish extra)")
    return str(found)


@pytest_asyncio.fixture
async def live(
    nats_url: str,
    database_url: str,
    pg_schema: str,
    subject_prefix: str,
    tmp_path: Path,
) -> AsyncIterator[Harness]:
    """A live engine with Redfish, one domain, two tenants, three compositions (one with a
    memory slice) and a reservation, so that every kind of resource exists for the crawl."""
    options = RedfishOptions(
        accounts=tmp_path / "redfish-accounts.json", admin_password=ADMIN_PASSWORD
    )
    async with serving(nats_url, database_url, pg_schema, subject_prefix, redfish=options) as h:
        assert (await h.client.import_topology(DOMAIN, FABRIC))["ok"]
        assert h.redfish_url is not None
        admin = RedfishHttp(h.redfish_url, "admin", ADMIN_PASSWORD)
        for body in (
            {"Links": {"ResourceBlocks": [{"@odata.id": f"{BLOCKS}/{DOMAIN}.host-01"},
                                          {"@odata.id": f"{BLOCKS}/{DOMAIN}.gpu-002"}]},
             "Oem": {"Trellis": {"Tenant": "acme"}}},
            {"Processors": {"Members": [{"@Redfish.RequestedCount": 1, "ProcessorType": "GPU"}]},
             "Memory": {"Members": [{"CapacityMiB": 65536}]},
             "Oem": {"Trellis": {"Tenant": "bolt"}}},
            {"Links": {"ResourceBlocks": [{"@odata.id": f"{BLOCKS}/{DOMAIN}.host-03"},
                                          {"@odata.id": f"{BLOCKS}/{DOMAIN}.nic-02"},
                                          {"@odata.id": f"{BLOCKS}/{DOMAIN}.nvme-02"}]},
             "Oem": {"Trellis": {"Tenant": "acme"}}},
        ):  # fmt: skip
            answer = await admin("POST", f"{R}/Systems", body)
            assert answer.status == 201, answer
        # A held reservation, so the crawl reads a CompositionReservation too.
        stanza = {
            "StanzaType": "ComposeSystem",
            "StanzaId": "reserved",
            "Request": {
                "Links": {
                    "ResourceBlocks": [
                        {"@odata.id": f"{BLOCKS}/{DOMAIN}.host-02"},
                        {"@odata.id": f"{BLOCKS}/{DOMAIN}.gpu-004"},
                    ]
                },
                "Oem": {"Trellis": {"Tenant": "acme"}},
            },
        }
        answer = await admin(
            "POST",
            f"{R}/CompositionService/Actions/CompositionService.Compose",
            {"RequestFormat": "Manifest", "RequestType": "PreviewReserve",
             "Manifest": {"Stanzas": [stanza]}},
        )  # fmt: skip
        assert answer.status == 200 and answer.body["ReservationId"], answer
        answer = await admin(
            "POST",
            f"{R}/AccountService/Accounts",
            {"UserName": "alice", "Password": "alice-password", "RoleId": "Operator",
             "Oem": {"Trellis": {"Tenant": "acme"}}},
        )  # fmt: skip
        assert answer.status == 201, answer
        yield h


async def _run(*args: str, timeout: float = 480) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def test_the_service_validator_crawls_a_live_instance_with_no_failures(
    live: Harness, tmp_path: Path
) -> None:
    tool = _tool("rf_service_validator")
    logs = tmp_path / "service-validator"
    code, out = await _run(
        tool, "--rhost", str(live.redfish_url), "--user", "admin", "--password", ADMIN_PASSWORD,
        "--schema_directory", str(CSDL), "--skipschema", "--logdir", str(logs),
    )  # fmt: skip
    summary = _summary(out)
    print(f"Redfish Service Validator: {summary}")
    assert summary.get("pass", 0) > 100, out[-4000:]
    assert summary.get("fail", 0) == 0, out[-8000:]
    assert code == 0, out[-4000:]


def _summary(out: str) -> dict[str, int]:
    """The Service Validator's closing table (PASS, WARN, FAIL, NOT TESTED) as counts."""
    rows = [line for line in out.splitlines() if line.startswith("|")]
    for header, values in itertools.pairwise(rows):
        if "PASS" in header and "FAIL" in header:
            names = [c.strip().lower() for c in header.strip("|").split("|")]
            numbers = [int(c.strip()) for c in values.strip("|").split("|")]
            return dict(zip(names, numbers, strict=True))
    return {}


#: Protocol Validator assertions this service fails on purpose or cannot meet, each explained
#: in docs/redfish.md ("What the Protocol Validator still reports").
KNOWN_PROTOCOL_FAILURES = set(
    re.findall(
        r"^\| `([A-Z][A-Z0-9_]+)` \|",
        (ROOT / "docs" / "redfish.md").read_text() if (ROOT / "docs" / "redfish.md").exists()
        else "",
        re.M,
    )
)  # fmt: skip


async def test_the_protocol_validator_fails_only_what_docs_name(
    live: Harness, tmp_path: Path
) -> None:
    tool = _tool("rf_protocol_validator")
    reports = tmp_path / "protocol-validator"
    _, out = await _run(
        tool, "--rhost", str(live.redfish_url), "--user", "admin", "--password", ADMIN_PASSWORD,
        "--report-dir", str(reports), "--report-type", "tsv", "--avoid-http-redirect",
    )  # fmt: skip
    tsv = sorted(reports.glob("*.tsv"))
    assert tsv, out[-4000:]
    failed = set()
    with tsv[-1].open() as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if row.get("Result", "").upper() == "FAIL":
                failed.add(row.get("Assertion", "").split(":")[0].strip())
    shutil.copy(tsv[-1], tmp_path / "protocol.tsv")
    with tsv[-1].open() as f:
        results = Counter(
            row.get("Result", "").upper() for row in csv.DictReader(f, delimiter="\t")
        )
    print(f"Redfish Protocol Validator: {dict(results)}, failed: {sorted(failed)}")
    assert failed <= KNOWN_PROTOCOL_FAILURES, (
        sorted(failed - KNOWN_PROTOCOL_FAILURES),
        out[-3000:],
    )
