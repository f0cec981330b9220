"""The Redfish service and its HTTP server under requests a careful client never sends: bad
credentials in bulk, retries, wrong types, odd request targets, stale preconditions (each test
names what it guards; docs/redfish.md says what the service promises)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from typing import Any

import pytest
from harness import Harness
from redfish_http import RedfishHttp, raw_exchange
from test_redfish_service import (
    ADMIN_PASSWORD,
    BLOCKS,
    COMPOSE,
    DOMAIN,
    R,
    admin,
    block,
    compose_action,
    connections,
    h,
    tenant_account,
)

from trellis.adapters.http import server
from trellis.adapters.http.redfish import accounts

__all__ = ["admin", "h"]  # fixtures


async def test_bad_basic_credentials_are_hashed_off_the_event_loop_a_few_at_a_time(
    admin: RedfishHttp, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    scrypt = accounts.hashlib.scrypt
    threads: list[int] = []
    hashing = [0, 0]  # now, most at once
    lock = threading.Lock()

    def watched_scrypt(*args: Any, **kwargs: Any) -> bytes:
        with lock:
            threads.append(threading.get_ident())
            hashing[0] += 1
            hashing[1] = max(hashing)
        try:
            time.sleep(0.02)
            return scrypt(*args, **kwargs)
        finally:
            with lock:
                hashing[0] -= 1

    monkeypatch.setattr(accounts.hashlib, "scrypt", watched_scrypt)
    intruder = admin.as_user("admin", "not-the-password")
    answers = await asyncio.gather(*(intruder.get(f"{R}/Systems") for _ in range(6)))
    assert [a.status for a in answers] == [401] * 6
    assert len(threads) == 6 and loop_thread not in threads
    assert hashing[1] <= accounts.HASHING_AT_ONCE
    anonymous = RedfishHttp(admin.base)
    login = await anonymous(
        "POST", f"{R}/SessionService/Sessions", {"UserName": "admin", "Password": "wrong-one"}
    )
    assert login.status == 401 and loop_thread not in threads


async def test_a_new_account_and_a_password_change_are_hashed_off_the_event_loop(
    admin: RedfishHttp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each scrypt (tens of ms) on the loop stalled every domain the engine serves: a tenant
    changing its own password in a loop held the engine's event loop (hostile-tenant probe)."""
    loop_thread = threading.get_ident()
    scrypt = accounts.hashlib.scrypt
    threads: list[int] = []

    def watched_scrypt(*args: Any, **kwargs: Any) -> bytes:
        threads.append(threading.get_ident())
        return scrypt(*args, **kwargs)

    monkeypatch.setattr(accounts.hashlib, "scrypt", watched_scrypt)
    carol = await tenant_account(admin, "carol", "acme")
    changed = await carol(
        "PATCH", f"{R}/AccountService/Accounts/carol", {"Password": "another-password"}
    )
    assert changed.status == 200, changed
    assert len(threads) >= 3 and loop_thread not in threads  # made, proven, changed
    assert (await admin.as_user("carol", "another-password").get(f"{R}/Systems")).status == 200


async def test_password_changes_judged_on_one_etag_make_one_change(
    admin: RedfishHttp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five PATCHes of a password with the same If-Match all answered 200 while each new
    password was hashed, and only the last one worked (the re-check probe): the precondition
    was judged before the hash and not again. One wins; the others are 412. A change whose
    account is deleted meanwhile is 404, not a 400 about a UserName it never sent."""
    await tenant_account(admin, "fred", "acme")
    scrypt = accounts.hashlib.scrypt

    def slow_scrypt(*args: Any, **kwargs: Any) -> bytes:
        time.sleep(0.05)  # the hashes of all five overlap
        return scrypt(*args, **kwargs)

    fred = f"{R}/AccountService/Accounts/fred"
    tag = (await admin.get(fred)).headers["etag"]
    monkeypatch.setattr(accounts.hashlib, "scrypt", slow_scrypt)
    answers = await asyncio.gather(*(
        admin("PATCH", fred, {"Password": f"fred-new-{i}"}, headers={"If-Match": tag})
        for i in range(5)
    ))  # fmt: skip
    assert sorted(a.status for a in answers) == [200, 412, 412, 412, 412], answers
    won = next(i for i, a in enumerate(answers) if a.status == 200)
    for i in range(5):
        status = (await admin.as_user("fred", f"fred-new-{i}").get(f"{R}/Systems")).status
        assert status == (200 if i == won else 401), (i, won)
    # `If-Match: *` holds while the account exists: each change is made, the last one stays.
    starred = await asyncio.gather(*(
        admin("PATCH", fred, {"Password": f"fred-star-{i}"}, headers={"If-Match": "*"})
        for i in range(3)
    ))  # fmt: skip
    assert [a.status for a in starred] == [200, 200, 200], starred
    changing = asyncio.create_task(admin("PATCH", fred, {"Password": "fred-newest"}))
    await asyncio.sleep(0.02)  # hashing
    assert (await admin("DELETE", fred)).status == 204
    gone = await changing
    assert gone.status == 404 and gone.messages() == ["ResourceNotFound"], gone


async def test_a_retry_with_the_same_idempotency_key_gets_the_first_answer(
    admin: RedfishHttp,
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    body = {"Links": {"ResourceBlocks": [block("host-04"), block("gpu-009")]}}
    first = await acme("POST", f"{R}/Systems", body, headers={"Idempotency-Key": "k-1"})
    again = await acme("POST", f"{R}/Systems", body, headers={"Idempotency-Key": "k-1"})
    assert (first.status, again.status) == (201, 201), again
    assert again.headers["location"] == first.headers["location"]
    other = await acme("POST", f"{R}/Systems", body, headers={"Idempotency-Key": "k-2"})
    assert (other.status, other.messages()) == (409, ["ResourceBlockInUse"])

    reserve = compose_action("PreviewReserve", "host-02", "gpu-003")
    made = await acme("POST", COMPOSE, reserve, headers={"Idempotency-Key": "k-3"})
    remade = await acme("POST", COMPOSE, reserve, headers={"Idempotency-Key": "k-3"})
    assert (made.status, remade.status) == (200, 200), remade
    assert remade.body["ReservationId"] == made.body["ReservationId"]

    apply = compose_action("Apply", "host-03", "gpu-007")
    applied = await acme("POST", COMPOSE, apply, headers={"Idempotency-Key": "k-4"})
    reapplied = await acme("POST", COMPOSE, apply, headers={"Idempotency-Key": "k-4"})
    assert (applied.status, reapplied.status) == (200, 200), reapplied
    assert reapplied.headers["location"] == applied.headers["location"]


async def test_compose_properties_of_the_wrong_type_or_range_are_400_naming_the_property(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    gpus = {"Links": {"ResourceBlocks": [block("host-01")]}}

    def processors(**member: Any) -> dict[str, Any]:
        return gpus | {"Processors": {"Members": [member]}}

    def memory(mib: Any) -> dict[str, Any]:
        return gpus | {"Memory": {"Members": [{"CapacityMiB": mib}]}}

    cases = [
        (processors(Model=["H100"]), "PropertyValueTypeError", "Processors/Members/0/Model"),
        (processors(ProcessorType=["GPU"]), "PropertyValueTypeError", "ProcessorType"),
        (processors(ProcessorType={"a": 1}), "PropertyValueTypeError", "ProcessorType"),
        (processors(ProcessorType="FPGA"), "PropertyValueNotInList", "ProcessorType"),
        (processors(**{"@Redfish.RequestedCount": 10**20}), "PropertyValueOutOfRange",
         "@Redfish.RequestedCount"),
        (memory(10**400), "PropertyValueOutOfRange", "Memory/Members/0/CapacityMiB"),
        (memory(1), "PropertyValueOutOfRange", "CapacityMiB"),
        (memory(1.5), "PropertyValueTypeError", "CapacityMiB"),
        (processors() | {"Name": "x" * 900_000}, "PropertyValueFormatError", "Name"),
        (processors() | {"Oem": {"Trellis": {"Labels": ["a"]}}}, "PropertyValueTypeError",
         "Oem/Trellis/Labels"),
        (processors() | {"Oem": {"Trellis": {"LeaseSeconds": 0}}}, "PropertyValueOutOfRange",
         "Oem/Trellis/LeaseSeconds"),
        (processors() | {"Oem": []}, "PropertyValueTypeError", "Oem"),
        ({"Links": {"ResourceBlocks": [block("host-01"),
                                       {"@odata.id": f"{BLOCKS}/{DOMAIN}"}]}},
         "ResourceBlockNotFound", DOMAIN),
    ]  # fmt: skip
    for body, name, where in cases:
        answer = await acme("POST", f"{R}/Systems", body)
        assert (answer.status, answer.messages()) == (400, [name]), (body, answer)
        first = answer.body["error"]["@Message.ExtendedInfo"][0]
        assert where in " ".join(first["MessageArgs"]), first
        assert "$." not in str(answer.body) and len(str(answer.body)) < 2000, answer
    wrong_id = {"RequestFormat": "Manifest", "RequestType": "Apply", "ReservationId": 7}
    answer = await acme("POST", COMPOSE, wrong_id)
    assert (answer.status, answer.messages()) == (400, ["PropertyValueTypeError"])
    assert await connections(h) == []


async def test_a_value_of_the_wrong_json_type_is_a_type_error_showing_it(
    h: Harness, admin: RedfishHttp
) -> None:
    """docs/redfish.md's error table: a wrong JSON type is PropertyValueTypeError with the value
    as JSON text and the property's path (it was PropertyValueFormatError with the property's
    name where the value belongs); a right type of the wrong form stays a format error."""
    host_gpu = {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    tenant = {"Oem": {"Trellis": {"Tenant": "acme"}}}
    cases = [
        (f"{R}/Systems", {"Links": []} | tenant, ["[]", "Links"]),
        (f"{R}/Systems", {"Links": {"ResourceBlocks": "x"}} | tenant,
         ['"x"', "Links/ResourceBlocks"]),
        (f"{R}/Systems", host_gpu | tenant | {"@Redfish.ZoneAffinity": 5},
         ["5", "@Redfish.ZoneAffinity"]),
        (f"{R}/Systems", host_gpu | tenant | {"Processors": []}, ["[]", "Processors"]),
        (f"{R}/Systems", host_gpu | tenant | {"Memory": {"Members": {}}}, ["{}", "Memory/Members"]),
        (f"{R}/Systems", host_gpu | {"Oem": {"Trellis": {"Tenant": 7}}},
         ["7", "Oem/Trellis/Tenant"]),
        (f"{R}/Systems", host_gpu | tenant | {"Processors": {"Members": [{"Model": ["H100"]}]}},
         ['["H100"]', "Processors/Members/0/Model"]),
        (COMPOSE, compose_action("Apply", "host-01") | {"RequestType": 5}, ["5", "RequestType"]),
        (COMPOSE, compose_action("Apply") | {"Manifest": {"Stanzas": {}}},
         ["{}", "Manifest/Stanzas"]),
        (COMPOSE, compose_action("Apply") | {"Manifest": {"Stanzas": [{
            "StanzaType": "ComposeSystem", "Request": "x"}]}},
         ['"x"', "Manifest/Stanzas/0/Request"]),
        (f"{R}/AccountService/Accounts", {"UserName": "bob", "Password": "bob-password",
          "RoleId": "Operator", "Enabled": "yes"} | tenant, ['"yes"', "Enabled"]),
        (f"{R}/AccountService/Accounts", {"UserName": 5, "Password": "bob-password",
          "RoleId": "Operator"} | tenant, ["5", "UserName"]),
    ]  # fmt: skip
    for path, body, args in cases:
        answer = await admin("POST", path, body)
        assert (answer.status, answer.messages()) == (400, ["PropertyValueTypeError"]), answer
        assert answer.body["error"]["@Message.ExtendedInfo"][0]["MessageArgs"] == args, answer
    misformed = await admin("POST", f"{R}/Systems", host_gpu | {"Oem": {"Trellis": {
        "Tenant": "not a tenant!"}}})  # fmt: skip
    assert (misformed.status, misformed.messages()) == (400, ["PropertyValueFormatError"])
    assert await connections(h) == []


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


async def test_head_on_the_event_stream_is_headers_only(admin: RedfishHttp) -> None:
    host = admin.base.split("://", 1)[1]
    answer = await raw_exchange(
        admin.base,
        f"HEAD {R}/EventService/SSE HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {basic('admin', ADMIN_PASSWORD)}\r\n\r\n".encode(),
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"OData-Version: 4.0" in head, answer
    assert head.count(b"Cache-Control") == 1 and b"Cache-Control: no-store" in head, head
    assert body == b""


async def test_an_open_event_stream_ends_when_its_credentials_do(
    h: Harness, admin: RedfishHttp
) -> None:
    await tenant_account(admin, "alice", "acme")
    await tenant_account(admin, "bob", "acme")
    login = await RedfishHttp(admin.base)(
        "POST", f"{R}/SessionService/Sessions", {"UserName": "alice", "Password": "alice-password"}
    )
    host = admin.base.split("://", 1)[1]
    streams = {}
    for name, credential in (
        ("alice", f"X-Auth-Token: {login.headers['x-auth-token']}"),
        ("bob", f"Authorization: {basic('bob', 'bob-password')}"),
    ):
        reader, writer = await asyncio.open_connection(*host.rsplit(":", 1))
        writer.write(
            f"GET {R}/EventService/SSE HTTP/1.1\r\nHost: {host}\r\n{credential}\r\n\r\n".encode()
        )
        while not (await reader.readline()).startswith(b": Trellis"):
            pass  # headers, then the stream's first line: it listens
        streams[name] = (reader, writer)
    changed = await admin(
        "PATCH", f"{R}/AccountService/Accounts/alice", {"Password": "another-password"}
    )
    assert changed.status == 200, changed
    assert (await admin("DELETE", f"{R}/AccountService/Accounts/bob")).status == 204
    made = await admin(
        "POST",
        f"{R}/Systems",
        {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]},
         "Oem": {"Trellis": {"Tenant": "acme"}}},
    )  # fmt: skip
    assert made.status == 201, made
    for name, (reader, writer) in streams.items():
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert b"data:" not in rest, (name, rest)


async def test_the_servers_own_refusals_are_redfish_error_bodies(admin: RedfishHttp) -> None:
    own = admin.base.split("://", 1)[1]
    auth = f"Authorization: {basic('admin', ADMIN_PASSWORD)}"
    post = f"POST {R}/Systems HTTP/1.1"
    for request_line, headers, status in [
        (f"GET {R}/Systems HTTP/1.1", ("Host: evil.example", auth), 421),
        # RFC 9112 5.1: no whitespace before a field's colon, and no line without one.
        (f"GET {R}/Systems HTTP/1.1", (f"Host: {own}", auth, "X-Pad : y"), 400),
        (f"GET {R}/Systems HTTP/1.1", (f"Host: {own}", auth, "garbage line"), 400),
        (f"GET {R}/Systems HTTP/1.1", (f"Host: {own}", auth, "Origin: http://evil.example"), 403),
        (f"TRACE {R}/Systems HTTP/1.1", (f"Host: {own}", auth), 405),
        ("GET //[ HTTP/1.1", (f"Host: {own}",), 400),
        (post, (f"Host: {own}", auth, "Content-Length: -1"), 400),
        (post, (f"Host: {own}", auth, "Content-Length: 5_0"), 400),
        (post, (f"Host: {own}", auth, "Transfer-Encoding: chunked"), 411),
        (post, (f"Host: {own}", auth, "Content-Length: 2000000"), 413),
    ]:
        lines = "".join(f"{header}\r\n" for header in headers)
        answer = await raw_exchange(admin.base, f"{request_line}\r\n{lines}\r\n".encode())
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == str(status).encode(), (request_line, headers, answer)
        assert b"OData-Version: 4.0" in head, answer
        assert set(json.loads(body)["error"]) == {"code", "message", "@Message.ExtendedInfo"}


async def test_a_request_too_large_or_of_an_unknown_method_is_answered_not_reset(
    admin: RedfishHttp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends a whole oversized body, or headers past the limit, reads the
    refusal: the server drops what it did not read before closing, where a close over unread
    data would reset the connection under the answer. A method HTTP does not define is 501."""
    own = admin.base.split("://", 1)[1]
    auth = f"Authorization: {basic('admin', ADMIN_PASSWORD)}"
    big = 2_000_000
    for data, status in [
        (
            f"POST {R}/Systems HTTP/1.1\r\nHost: {own}\r\n{auth}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {big}\r\n\r\n".encode()
            + b" " * big,
            413,
        ),
        (f"GET {R}/Systems HTTP/1.1\r\nHost: {own}\r\nX-Pad: {'a' * 20_000}\r\n\r\n".encode(), 431),
        (
            f"GET {R}/Systems HTTP/1.1\r\nHost: {own}\r\nX-Pad: {'a' * 900_000}\r\n\r\n".encode(),
            431,
        ),
        (f"BREW {R}/Systems HTTP/1.1\r\nHost: {own}\r\n{auth}\r\n\r\n".encode(), 501),
    ]:
        answer = await raw_exchange(admin.base, data)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == str(status).encode(), answer[:300]
        assert set(json.loads(body)["error"]) == {"code", "message", "@Message.ExtendedInfo"}
    # A HEAD's refusal has no body: its headers too large, or too slow to come (the
    # re-checks).
    too_large = f"HEAD {R}/Systems HTTP/1.1\r\nHost: {own}\r\nX-Pad: {'a' * 20_000}\r\n\r\n"
    head, _, body = (await raw_exchange(admin.base, too_large.encode())).partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"431" and body == b"", (head, body)
    monkeypatch.setattr(server, "_READ_TIMEOUT_S", 0.3)
    unfinished = f"HEAD {R}/Systems HTTP/1.1\r\nHost: {own}\r\n".encode()  # no blank line
    answer = await raw_exchange(admin.base, unfinished)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400" and body == b"", answer


async def test_the_last_enabled_administrator_stays_and_an_empty_patch_changes_nothing(
    admin: RedfishHttp,
) -> None:
    accounts_url = f"{R}/AccountService/Accounts"
    refused = await admin("PATCH", f"{accounts_url}/admin", {"Enabled": False})
    assert (refused.status, refused.messages()) == (409, ["ResourceInUse"]), refused
    before = await admin.get(f"{accounts_url}/admin")
    assert before.body["Enabled"] is True
    unchanged = await admin("PATCH", f"{accounts_url}/admin", {})
    assert unchanged.status == 200 and unchanged.headers["etag"] == before.headers["etag"]

    second = {"UserName": "root2", "Password": "root2-password", "RoleId": "Administrator"}
    assert (await admin("POST", accounts_url, second)).status == 201
    assert (await admin("PATCH", f"{accounts_url}/admin", {"Enabled": False})).status == 200
    root2 = admin.as_user("root2", "root2-password")
    last = await root2("PATCH", f"{accounts_url}/root2", {"Enabled": False})
    assert (last.status, last.messages()) == (409, ["ResourceInUse"]), last
    assert (await root2("DELETE", f"{accounts_url}/root2")).status == 409
    assert (await root2("PATCH", f"{accounts_url}/admin", {"Enabled": True})).status == 200

    typed = {"UserName": "carol", "Password": "carol-password", "RoleId": "Operator",
             "Enabled": "false", "Oem": {"Trellis": {"Tenant": "acme"}}}  # fmt: skip
    wrong = await admin("POST", accounts_url, typed)
    assert (wrong.status, wrong.messages()) == (400, ["PropertyValueTypeError"]), wrong
    assert (await admin.get(f"{accounts_url}/carol")).status == 404
    await tenant_account(admin, "alice", "acme")
    again = await admin("POST", accounts_url, second | {"UserName": "alice"})
    assert (again.status, again.messages()) == (409, ["ResourceAlreadyExists"])
    args = again.body["error"]["@Message.ExtendedInfo"][0]["MessageArgs"]
    assert args == ["ManagerAccount", "UserName", "alice"]


async def test_a_stale_if_match_stops_an_action_and_a_session_delete(
    h: Harness, admin: RedfishHttp
) -> None:
    acme = await tenant_account(admin, "alice", "acme")
    reserve = compose_action("PreviewReserve", "host-01", "gpu-002")
    stale = {"If-Match": 'W/"stale"'}
    refused = await acme("POST", COMPOSE, reserve, headers=stale)
    assert (refused.status, refused.messages()) == (412, ["PreconditionFailed"]), refused
    assert (await acme.get(f"{R}/CompositionService/CompositionReservations")).body["Members"] == []
    current = (await acme.get(f"{R}/CompositionService")).headers["etag"]
    made = await acme("POST", COMPOSE, reserve, headers={"If-Match": current})
    assert made.status == 200, made

    anonymous = RedfishHttp(admin.base)
    login = await anonymous(
        "POST", f"{R}/SessionService/Sessions", {"UserName": "alice", "Password": "alice-password"}
    )
    token = {"X-Auth-Token": login.headers["x-auth-token"]}
    session = login.headers["location"]
    kept = await anonymous("DELETE", session, headers=token | stale)
    assert (kept.status, kept.messages()) == (412, ["PreconditionFailed"]), kept
    etag = (await anonymous.get(session, headers=token)).headers["etag"]
    assert (await anonymous("DELETE", session, headers=token | {"If-Match": etag})).status == 204


async def test_credentials_are_checked_first_and_allow_says_what_is_allowed(
    admin: RedfishHttp,
) -> None:
    anonymous = RedfishHttp(admin.base)
    for path, headers in [
        (f"{R}/Systems?$expand=.", {}),
        (f"{R}/Systems", {"OData-Version": "4.01"}),
    ]:
        answer = await anonymous.get(path, headers=headers)
        assert (answer.status, answer.messages()) == (401, ["NoValidSession"]), path
    version = await admin.get(f"{R}/Systems", headers={"OData-Version": "4.01"})
    assert (version.status, version.messages()) == (412, ["HeaderInvalid"]), version
    assert "ETag" not in version.body["error"]["message"]
    assert (await admin.get(f"{R}/Systems?$expand=.")).status == 501

    capabilities = f"{R}/Systems/Capabilities"
    read = await admin.get(capabilities)
    deleted = await admin("DELETE", capabilities)
    assert deleted.status == 405 and deleted.headers["allow"] == read.headers["allow"]
    assert read.headers["allow"] == "GET, HEAD"
    for method in ("DELETE", "POST", "PATCH", "PUT", "OPTIONS"):
        answer = await anonymous(method, "/redfish")
        assert (answer.status, answer.headers["allow"]) == (405, "GET, HEAD"), method
    assert (await anonymous.get("/redfish")).status == 200


async def test_a_body_not_json_is_415_and_a_long_path_is_not_echoed_in_full(
    admin: RedfishHttp,
) -> None:
    host = admin.base.split("://", 1)[1]
    body = b'{"Links": {}}'
    answer = await raw_exchange(
        admin.base,
        f"POST {R}/Systems HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: {basic('admin', ADMIN_PASSWORD)}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    assert answer.startswith(b"HTTP/1.1 415 "), answer
    long_path = f"{R}/Fabrics/{'x' * 15_000}"
    missing = await admin.get(long_path)
    assert missing.status == 404 and len(json.dumps(missing.body)) < 3_000


async def raw_post(admin: RedfishHttp, path: str, body: bytes, credentials: bool) -> bytes:
    """POST `body` as sent (json.dumps could not encode some of them)."""
    host = admin.base.split("://", 1)[1]
    auth = f"Authorization: {basic('admin', ADMIN_PASSWORD)}\r\n" if credentials else ""
    return await raw_exchange(
        admin.base,
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )


async def test_hostile_compose_bodies_are_refused_whole_typed_and_short(
    h: Harness, admin: RedfishHttp
) -> None:
    """What a probe sent as a tenant: JSON nested past the decoder's depth (was a 500 and a
    traceback, without credentials), thousands of blocks (checked for repeats in quadratic
    time on the engine's loop: seconds per request), constraints the service does not know
    (dropped: a typo composed any model), and more members than the engine takes."""
    nested = b"[" * 5_000 + b"]" * 5_000
    for path in (f"{R}/SessionService/Sessions", f"{R}/Systems"):
        answer = await raw_post(admin, path, nested, credentials=path.endswith("Systems"))
        assert answer.startswith(b"HTTP/1.1 400 ") and b"MalformedJSON" in answer, answer[:300]

    acme = await tenant_account(admin, "alice", "acme")
    host = block("host-01")

    async def refused(body: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
        answer = await acme("POST", f"{R}/Systems", body)
        assert answer.status == 400, answer
        assert len(json.dumps(answer.body)) < 20_000, len(json.dumps(answer.body))
        return answer.messages(), answer.body["error"]["@Message.ExtendedInfo"]

    names, _ = await refused({"Links": {"ResourceBlocks": [host] + [block("gpu-002")] * 5_000}})
    assert names == ["PropertyValueOutOfRange"]
    names, info = await refused({"Links": {"ResourceBlocks": [host] + [block("gpu-002")] * 4_000}})
    assert names == ["ResourceBlockInvalid"]
    assert info[0]["RelatedProperties"] == ["/Links/ResourceBlocks"], info  # RFC 6901
    names, info = await refused({"Links": {"ResourceBlocks": [host, {"@odata.id": "/x"}]}})
    assert names == ["ResourceBlockInvalid"]
    assert info[0]["RelatedProperties"] == ["/Links/ResourceBlocks"], info
    unknown = [block(f"gpu-x{i}") for i in range(3_000)]
    names, info = await refused({"Links": {"ResourceBlocks": [host, *unknown]}})
    assert names == ["ResourceBlockNotFound"] * 16 + ["GeneralError"], names
    assert info[-1]["Resolution"].startswith("2984 more blocks"), info[-1]

    def gpus(**member: Any) -> dict[str, Any]:
        return {"Links": {"ResourceBlocks": [host]}, "Processors": {"Members": [member]}}

    names, info = await refused(gpus(Modell="H100-nonexistent"))
    assert names == ["PropertyUnknown"], names
    assert info[0]["MessageArgs"] == ["Processors/Members/0/Modell"], info
    assert "Model" in info[0]["Resolution"], info
    names, _ = await refused(gpus(RequestedCount=2))
    assert names == ["PropertyUnknown"]
    names, _ = await refused(gpus(**{"@Redfish.AllowOverprovisioning": True}))
    assert names == ["PropertyValueNotInList"]
    many = {"Links": {"ResourceBlocks": [host]},
            "Storage": {"Members": [{"@Redfish.RequestedCount": 1}] * 65}}  # fmt: skip
    names, info = await refused(many)
    assert names == ["PropertyValueOutOfRange"] and "Storage/Members" in info[0]["MessageArgs"]
    names, info = await refused({"Links": {"ResourceBlocks": [host]}})
    assert names == ["PropertyMissing"] and "at least one device" in info[0]["Resolution"]
    assert await connections(h) == []

    # A constraint it keeps anyway is taken, and the Name a client composes with is the
    # system's Name.
    made = await acme("POST", f"{R}/Systems",
                      gpus(**{"@Redfish.AllowOverprovisioning": False, "Model": "H100"})
                      | {"Name": "decode pool 7"})  # fmt: skip
    assert made.status == 201, made
    assert made.body["Name"] == "decode pool 7"
    assert (await acme.get(f"{R}/Systems/{made.body['Id']}")).body["Name"] == "decode pool 7"
    assert [r["device"] for r in await connections(h)] == ["gpu-002"]


async def test_a_create_with_a_property_it_does_not_take_is_refused_naming_it(
    h: Harness, admin: RedfishHttp
) -> None:
    """What a tester sent: misspelt properties of a compose (top level, Oem.Trellis) and of a
    new account were dropped, so a typo composed less than asked (201) or no lease."""
    acme = await tenant_account(admin, "alice", "acme")
    gpu = {"Links": {"ResourceBlocks": [block("host-01"), block("gpu-002")]}}
    cases = [
        ({"Memroy": {"Members": [{"CapacityMiB": 65536}]}}, "Memroy"),
        ({"@Redfish.ZoneAfinity": f"{R}/CompositionService/ResourceZones/{DOMAIN}"},
         "@Redfish.ZoneAfinity"),
        ({"Bogus": 1}, "Bogus"),
        ({"Oem": {"Trellis": {"LeaseSecond": 60}}}, "Oem/Trellis/LeaseSecond"),
        ({"Oem": {"Trelis": {"LeaseSeconds": 60}}}, "Oem/Trelis"),
        ({"Links": {"ResourceBlock": [block("gpu-004")]}}, "Links/ResourceBlock"),
    ]  # fmt: skip
    for extra, where in cases:
        answer = await acme("POST", f"{R}/Systems", gpu | extra)
        assert (answer.status, answer.messages()) == (400, ["PropertyUnknown"]), (extra, answer)
        assert answer.body["error"]["@Message.ExtendedInfo"][0]["MessageArgs"] == [where]
    tenant_typo = gpu | {"Oem": {"Trellis": {"Tennant": "acme"}}}
    answer = await admin("POST", f"{R}/Systems", tenant_typo)
    assert (answer.status, answer.messages()) == (400, ["PropertyUnknown"]), answer

    def stanza_request(**extra: Any) -> dict[str, Any]:
        body = compose_action("Apply", "host-01", "gpu-002")
        body["Manifest"]["Stanzas"][0]["Request"] |= extra
        return body

    apply_cases = [
        (compose_action("Apply", "host-01", "gpu-002", Bogus=1), "ActionParameterUnknown",
         ["CompositionService.Compose", "Bogus"]),
        (compose_action("Apply", "host-01", "gpu-002") | {"Oem": {"Trellis": {"Tennant": "x"}}},
         "ActionParameterUnknown", ["CompositionService.Compose", "Oem/Trellis/Tennant"]),
        (stanza_request(Memroy={}), "PropertyUnknown", ["Manifest/Stanzas/0/Request/Memroy"]),
    ]  # fmt: skip
    stanza_typo = compose_action("Apply", "host-01", "gpu-002")
    stanza_typo["Manifest"]["Stanzas"][0]["Requets"] = {}
    apply_cases.append((stanza_typo, "ActionParameterUnknown",
                        ["CompositionService.Compose", "Manifest/Stanzas/0/Requets"]))  # fmt: skip
    for body, name, args in apply_cases:
        answer = await acme("POST", COMPOSE, body)
        assert (answer.status, answer.messages()) == (400, [name]), (body, answer)
        assert answer.body["error"]["@Message.ExtendedInfo"][0]["MessageArgs"] == args
    assert await connections(h) == []
    assert (await acme.get(f"{R}/Systems")).body["Members"] == []

    account = {"UserName": "bob", "Password": "bob-password", "RoleId": "Operator",
               "Oem": {"Trellis": {"Tenant": "acme"}}}  # fmt: skip
    for extra, where in [({"Bogus": 1}, "Bogus"),
                         ({"Oem": {"Trellis": {"Tenant": "acme", "Tennant": "x"}}},
                          "Oem/Trellis/Tennant")]:  # fmt: skip
        answer = await admin("POST", f"{R}/AccountService/Accounts", account | extra)
        assert (answer.status, answer.messages()) == (400, ["PropertyUnknown"]), answer
        assert answer.body["error"]["@Message.ExtendedInfo"][0]["MessageArgs"] == [where]
    assert (await admin.get(f"{R}/AccountService/Accounts/bob")).status == 404

    # What a Redfish client legitimately sends beside them is taken.
    kept = {"@odata.type": "#ManagerAccount.v1_12_0.ManagerAccount", "Name": "Bob",
            "Description": "an operator", "Enabled": True, "Locked": False}  # fmt: skip
    made = await admin("POST", f"{R}/AccountService/Accounts", account | kept)
    assert made.status == 201, made
    system = gpu | {"@odata.type": "#ComputerSystem.v1_22_0.ComputerSystem",
                    "Name": "decode", "Description": "pool 7",
                    "@Redfish.ZoneAffinity": f"{R}/CompositionService/ResourceZones/{DOMAIN}",
                    "Oem": {"Trellis": {"Tenant": "acme", "Labels": {"team": "a"},
                                        "LeaseSeconds": 600}}}  # fmt: skip
    assert (await acme("POST", f"{R}/Systems", system)).status == 201


async def test_a_query_parameter_not_beginning_with_dollar_is_ignored(admin: RedfishHttp) -> None:
    """DSP0266: a service ignores an unsupported query parameter that does not begin with `$`
    (`only` and `excerpt` were 501); `$` ones it does not support stay 501."""
    plain = await admin.get(f"{R}/Systems")
    for query in ("only", "excerpt", "only&excerpt", "foo=bar"):
        answer = await admin.get(f"{R}/Systems?{query}")
        assert (answer.status, answer.body) == (200, plain.body), (query, answer)
    for query in ("$expand=.", "$select=Name", "only&$filter=x"):
        answer = await admin.get(f"{R}/Systems?{query}")
        assert (answer.status, answer.messages()) == (501, ["QueryNotSupported"]), query


async def test_a_patch_changes_what_it_may_and_says_what_it_left(admin: RedfishHttp) -> None:
    """DSP0266 "Update a resource", as the Protocol Validator's REQ_PATCH_MIXED_PROPS and
    REQ_PATCH_ODATA_PROPS check it: a writable property beside an unknown one is set (200, the
    unknown one named in @Message.ExtendedInfo); annotations alone change nothing (200)."""
    await tenant_account(admin, "rita", "acme", role="ReadOnly")
    rita = f"{R}/AccountService/Accounts/rita"
    mixed = await admin("PATCH", rita, {"Password": "rita-password-2", "BogusProp": "foo"})
    assert mixed.status == 200, mixed
    (note,) = mixed.body["@Message.ExtendedInfo"]
    assert note["MessageId"].endswith("PropertyUnknown") and note["MessageArgs"] == ["BogusProp"]
    assert mixed.headers["etag"] == (await admin.get(rita)).headers["etag"]
    assert (await admin.as_user("rita", "rita-password-2").get(f"{R}/Systems")).status == 200
    before = await admin.get(rita)
    annotations = await admin("PATCH", rita, {"@odata.id": rita})
    assert annotations.status == 200 and annotations.headers["etag"] == before.headers["etag"]
    only_unknown = await admin("PATCH", rita, {"BogusProp": "foo"})
    assert (only_unknown.status, only_unknown.messages()) == (400, ["PropertyUnknown"])


async def test_a_path_that_does_not_exist_is_404_whatever_the_method(admin: RedfishHttp) -> None:
    for method, path in [
        ("DELETE", f"{R}/Fabrics/{DOMAIN}/nonexist"),
        ("POST", f"{R}/Fabrics/nonexist"),
        ("DELETE", f"{R}/CompositionService/nonexist"),
        ("PATCH", f"{R}/CompositionService/ResourceBlocks/{DOMAIN}.nonexist"),
    ]:
        answer = await admin(method, path, {} if method != "DELETE" else None)
        assert (answer.status, answer.messages()) == (404, ["ResourceNotFound"]), (method, path)
    there = await admin("DELETE", f"{R}/Fabrics/{DOMAIN}")
    assert (there.status, there.headers["allow"]) == (405, "GET, HEAD")
