"""The Redfish AccountService and SessionService (DSP0266 §13): the service's accounts and
sessions (accounts.py keeps them), as resources."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from trellis.adapters.http.redfish import resources as rs
from trellis.adapters.http.redfish.accounts import (
    MAX_PASSWORD,
    MIN_PASSWORD,
    PRIVILEGES,
    ROLES,
    SESSION_TIMEOUT_RANGE,
    Account,
    AccountChanged,
    AccountError,
    AccountGone,
    AccountStore,
    LastAdministrator,
    Session,
)
from trellis.adapters.http.redfish.handling import (
    Reply,
    admin_only,
    dig,
    if_match,
    json_body,
    only,
    patched,
    refuse_unknown,
    with_notes,
    wrong_type,
)
from trellis.adapters.http.redfish.registries import RedfishError, error, message
from trellis.adapters.http.redfish.resources import R, ref
from trellis.adapters.http.redfish.session_timeout import SessionTimeout
from trellis.adapters.http.server import Request

#: What a new ManagerAccount may say: `Locked` (false) is what many clients send as they make
#: one, and a new account is never locked.
ACCOUNT_PROPERTIES = {"UserName", "Password", "RoleId", "Enabled", "Locked", "Oem", "Name",
                      "Description"}  # fmt: skip


async def account_service(
    store: AccountStore, request: Request, method: str, parts: list[str], account: Account
) -> Reply:
    """`/redfish/v1/AccountService` and below: roles, and accounts an Administrator makes,
    changes and deletes (an account sees only itself otherwise)."""
    base = f"{R}/AccountService"
    if not parts:
        only(method, "GET")
        return Reply(body=_account_service())
    if parts[0] == "Roles":
        only(method, "GET")
        if len(parts) == 1:
            members = [f"{base}/Roles/{r}" for r in ROLES]
            return Reply(body=rs.collection(f"{base}/Roles", "RoleCollection", "Roles",
                                            members))  # fmt: skip
        if len(parts) == 2 and parts[1] in ROLES:
            return Reply(body=_role(parts[1]))
    if parts[0] == "Accounts" and len(parts) == 1:
        if method == "POST":
            admin_only(account)
            body = json_body(request)
            _refuse_unknown_account_properties(body)
            _check_types(body)
            _check_required(body)
            try:
                made = await store.create(
                    body["UserName"],
                    body["Password"],
                    body["RoleId"],
                    dig(body, "Oem", "Trellis", "Tenant"),
                )
            except AccountError as exc:
                raise _account_error(exc, str(body.get("UserName"))) from None
            if body.get("Enabled") is False:
                made = await store.update(made.user_name, enabled=False)
            return Reply(
                status=201,
                body=_account(made),
                headers=[("Location", f"{base}/Accounts/{made.id}")],
                allow="GET, HEAD, PATCH, DELETE",
            )
        only(method, "GET", "POST")
        visible = [a for a in store.all() if account.admin or a.id == account.id]
        members = [f"{base}/Accounts/{a.id}" for a in visible]
        body = rs.collection(f"{base}/Accounts", "ManagerAccountCollection", "Accounts",
                             members)  # fmt: skip
        return Reply(body=body, allow="GET, HEAD, POST")
    if parts[0] == "Accounts" and len(parts) == 2:
        target = store.get(parts[1])
        if target is None or not (account.admin or target.id == account.id):
            raise error(404, "ResourceNotFound", "ManagerAccount", parts[1])
        current = _account(target)
        allow = "GET, HEAD, PATCH, DELETE"
        if method == "PATCH":
            if_match(request, current)
            body, notes = patched(json_body(request), {"Password", "Enabled"}, current)
            if "Enabled" in body and not account.admin:
                raise error(403, "InsufficientPrivilege")
            _check_types(body)
            try:
                changed = await store.update(
                    target.user_name,
                    password=body.get("Password"),
                    enabled=body.get("Enabled"),
                    # The If-Match was judged on this version: it must still be the account's
                    # once the new password is hashed.
                    unchanged_since=(
                        target.version
                        if request.headers.get("if-match", "*").strip() != "*"
                        else None  # `*` holds while the account exists (RFC 9110 13.1.1)
                    ),
                )
            except AccountError as exc:
                raise _account_error(exc, target.user_name) from None
            return Reply(body=with_notes(_account(changed), notes), allow=allow)
        if method == "DELETE":
            admin_only(account)
            if_match(request, current)
            try:
                store.delete(target.user_name)
            except AccountError as exc:
                raise error(409, "ResourceCannotBeDeleted", resolution=f"{exc}.") from None
            return Reply(status=204, body=None, allow=allow)
        only(method, "GET", "PATCH", "DELETE")
        return Reply(body=current, allow=allow)
    raise error(404, "ResourceNotFound", "Resource", "/".join(parts))


async def session_service(
    timeout: SessionTimeout,
    login: Callable[[Request, str, str], Awaitable[Account]],
    request: Request,
    method: str,
    parts: list[str],
    account: Account | None,
) -> Reply:
    """`/redfish/v1/SessionService` and below: a POST of a user name and password opens a
    session (its token in X-Auth-Token); a session is listed, read and closed by its user or
    an Administrator. An Administrator PATCHes SessionTimeout, the one writable property."""
    store = timeout.store
    base = f"{R}/SessionService"
    if not parts:
        allow = "GET, HEAD, PATCH"
        if method == "PATCH":
            assert account is not None
            admin_only(account)
            current = _session_service(timeout.seconds)
            if_match(request, current)
            body, notes = patched(json_body(request), {"SessionTimeout"}, current)
            if "SessionTimeout" in body:
                timeout.set(_session_timeout(body["SessionTimeout"]))
            return Reply(body=with_notes(_session_service(timeout.seconds), notes), allow=allow)
        only(method, "GET", "PATCH")
        return Reply(body=_session_service(timeout.seconds), allow=allow)
    if parts[0] != "Sessions" or len(parts) > 2:
        raise error(404, "ResourceNotFound", "Resource", "/".join(parts))
    if len(parts) == 1:
        if method == "POST":
            body = json_body(request)
            user, password = body.get("UserName"), body.get("Password")
            if not isinstance(user, str) or not isinstance(password, str):
                missing = "UserName" if not isinstance(user, str) else "Password"
                raise error(400, "PropertyMissing", missing)
            # As on any other POST; Context is the client's own note on its session.
            refuse_unknown(body, ("UserName", "Password", "Context"))
            context = body.get("Context", "")
            if not isinstance(context, str):
                raise wrong_type(context, "Context")
            if len(context) > 256:  # kept in memory with the session
                raise error(400, "PropertyValueOutOfRange", context[:64], "Context")
            session = store.open_session(await login(request, user, password), context)
            return Reply(
                status=201,
                body=_session(session),
                headers=[
                    ("X-Auth-Token", session.token),
                    ("Location", f"{base}/Sessions/{session.id}"),
                ],
                allow="GET, HEAD, DELETE",
            )
        only(method, "GET", "POST")
        assert account is not None
        visible = [s for s in store.sessions()
                   if account.admin or s.user_name == account.user_name]  # fmt: skip
        members = [f"{base}/Sessions/{s.id}" for s in visible]
        body = rs.collection(f"{base}/Sessions", "SessionCollection", "Sessions", members)
        return Reply(body=body, allow="GET, HEAD, POST")
    assert account is not None
    known = store.session(parts[1])
    if known is None or not (account.admin or known.user_name == account.user_name):
        raise error(404, "ResourceNotFound", "Session", parts[1])
    session = known
    if method == "DELETE":
        if_match(request, _session(session))
        store.close_session(session.id)
        return Reply(status=204, body=None, allow="GET, HEAD, DELETE")
    only(method, "GET", "DELETE")
    return Reply(body=_session(session), allow="GET, HEAD, DELETE")


def _refuse_unknown_account_properties(body: dict[str, Any]) -> None:
    """Refuse a new account saying what a ManagerAccount create does not take, rather than
    make it without what was misspelt."""
    refuse_unknown(body, ACCOUNT_PROPERTIES)
    oem = body.get("Oem")
    if isinstance(oem, dict):
        refuse_unknown(oem, {"Trellis"}, "Oem/")
        trellis = oem.get("Trellis")
        if isinstance(trellis, dict):
            refuse_unknown(trellis, {"Tenant"}, "Oem/Trellis/")


def _check_types(body: dict[str, Any]) -> None:
    """A value of the wrong JSON type is PropertyValueTypeError (a string of the wrong form is
    the store's PropertyValueFormatError)."""
    enabled = body.get("Enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise wrong_type(enabled, "Enabled")
    texts = {"UserName": body.get("UserName"), "RoleId": body.get("RoleId"),
             "Oem/Trellis/Tenant": dig(body, "Oem", "Trellis", "Tenant")}  # fmt: skip
    for where, value in texts.items():
        if value is not None and not isinstance(value, str):
            raise wrong_type(value, where)
    password = body.get("Password")
    if password is not None and not isinstance(password, str):
        raise error(400, "PropertyValueTypeError", "(hidden)", "Password")  # never echoed


def _check_required(body: dict[str, Any]) -> None:
    """A new account's missing property is PropertyMissing naming it (every one missing), and a
    RoleId not among the roles PropertyValueNotInList listing them: the client is told what to
    send, not that some value was of the wrong form."""
    missing = [name for name in ("UserName", "Password", "RoleId") if body.get(name) is None]
    role = body.get("RoleId")
    if role in ("Operator", "ReadOnly") and dig(body, "Oem", "Trellis", "Tenant") is None:
        missing.append("Oem/Trellis/Tenant")
    if missing:
        tenant = f"{role} accounts belong to one tenant: name it and resubmit the request."
        raise RedfishError(400, [
            message("PropertyMissing", name, related=[f"#/{name}"],
                    resolution=tenant if name.startswith("Oem/") else None)
            for name in missing
        ])  # fmt: skip
    if role not in ROLES:
        raise error(400, "PropertyValueNotInList", str(role), "RoleId", related=["#/RoleId"],
                    resolution=f"Send RoleId as one of {', '.join(ROLES)}.")  # fmt: skip


def _account_error(exc: AccountError, user_name: str) -> RedfishError:
    """The Redfish answer to a refused account change of `user_name`."""
    if isinstance(exc, LastAdministrator):
        return error(409, "ResourceInUse", resolution=f"{exc}: enable another one first.")
    if isinstance(exc, AccountGone):
        return error(404, "ResourceNotFound", "ManagerAccount", user_name)
    if isinstance(exc, AccountChanged):
        return error(412, "PreconditionFailed")
    if "exists" in str(exc):
        return error(409, "ResourceAlreadyExists", "ManagerAccount", "UserName", user_name)
    return error(400, "PropertyValueFormatError", "(hidden)", exc.field or "Body",
                 resolution=str(exc))  # fmt: skip


def _account_service() -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/AccountService",
        "@odata.type": "#AccountService.v1_18_1.AccountService",
        "Id": "AccountService",
        "Name": "Account Service",
        "ServiceEnabled": True,
        "MinPasswordLength": MIN_PASSWORD,
        "MaxPasswordLength": MAX_PASSWORD,
        "LocalAccountAuth": "Enabled",
        "Accounts": ref(f"{R}/AccountService/Accounts"),
        "Roles": ref(f"{R}/AccountService/Roles"),
    }


def _role(role: str) -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/AccountService/Roles/{role}",
        "@odata.type": "#Role.v1_3_3.Role",
        "Id": role,
        "Name": f"{role} role",
        "RoleId": role,
        "IsPredefined": True,
        "AssignedPrivileges": PRIVILEGES[role],  # type: ignore[index]
    }


def _account(account: Account) -> dict[str, Any]:
    body: dict[str, Any] = {
        "@odata.id": f"{R}/AccountService/Accounts/{account.id}",
        "@odata.type": "#ManagerAccount.v1_14_1.ManagerAccount",
        "Id": account.id,
        "Name": f"account {account.user_name}",
        "UserName": account.user_name,
        "RoleId": account.role,
        "Enabled": account.enabled,
        "Locked": False,
        "Password": None,
        "AccountTypes": ["Redfish"],
        "Links": {"Role": ref(f"{R}/AccountService/Roles/{account.role}")},
        "Oem": {"Trellis": {"Tenant": account.tenant, "Version": account.version}},
    }
    return body


def _session_timeout(value: Any) -> int:
    """SessionTimeout's seconds: a whole number within the CSDL's bounds."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise wrong_type(value, "SessionTimeout")
    low, high = SESSION_TIMEOUT_RANGE
    if not low <= value <= high:
        raise error(400, "PropertyValueOutOfRange", str(value), "SessionTimeout",
                    resolution=f"Send a whole number of seconds from {low} to {high}.")  # fmt: skip
    return value


def _session_service(timeout_s: int) -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/SessionService",
        "@odata.type": "#SessionService.v1_2_0.SessionService",
        "Id": "SessionService",
        "Name": "Session Service",
        "ServiceEnabled": True,
        "SessionTimeout": timeout_s,
        "Status": {"State": "Enabled", "Health": "OK"},
        "Sessions": ref(f"{R}/SessionService/Sessions"),
    }


def _session(session: Session) -> dict[str, Any]:
    return {
        "@odata.id": f"{R}/SessionService/Sessions/{session.id}",
        "@odata.type": "#Session.v1_8_0.Session",
        "Id": session.id,
        "Name": f"session of {session.user_name}",
        "UserName": session.user_name,
        "SessionType": "Redfish",
        **({"Context": session.context} if session.context else {}),
    }
