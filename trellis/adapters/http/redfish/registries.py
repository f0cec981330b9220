"""Redfish error bodies (DSP0266 §9.6): `error` with a `code`, a `message` and
`@Message.ExtendedInfo`, each message taken from DMTF's `Base` or `Composition` registry
(DSP8011), and the HTTP status that each engine error code maps to (ARCHITECTURE §11,
"HTTP status for engine codes").

Only the messages this service sends are here, with their registry text. Message ids name the
registry's major.minor version, as DSP0266 allows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

BASE = "Base.1.19"
MAX_ARG = 256  # characters of a message argument
COMPOSITION = "Composition.1.1"


class Message(NamedTuple):
    registry: str
    text: str  # %1, %2 ... are the arguments
    severity: str
    resolution: str


MESSAGES: dict[str, Message] = {
    # Base (DSP8011 Base registry)
    "GeneralError": Message(
        BASE,
        "A general error has occurred.  See Resolution for information on how to resolve "
        "the error, or @Message.ExtendedInfo if Resolution is not provided.",
        "Critical",
        "None.",
    ),
    "Created": Message(BASE, "The resource was created successfully.", "OK", "None."),
    "Success": Message(BASE, "The request completed successfully.", "OK", "None."),
    "MalformedJSON": Message(
        BASE,
        "The request body submitted was malformed JSON and could not be parsed by the "
        "receiving service.",
        "Critical",
        "Ensure that the request body is valid JSON and resubmit the request.",
    ),
    "PropertyMissing": Message(
        BASE,
        "The property %1 is a required property and must be included in the request.",
        "Warning",
        "Ensure that the property is in the request body and has a valid value and resubmit "
        "the request if the operation failed.",
    ),
    "PropertyValueFormatError": Message(
        BASE,
        "The value '%1' for the property %2 is not a format that the property can accept.",
        "Warning",
        "Correct the value for the property in the request body and resubmit the request if "
        "the operation failed.",
    ),
    "HeaderInvalid": Message(
        BASE,
        "The header '%1' is invalid.",
        "Critical",
        "Resubmit the request with a valid header.",
    ),
    "PropertyValueTypeError": Message(
        BASE,
        "The value '%1' for the property %2 is not a type that the property can accept.",
        "Warning",
        "Correct the value for the property in the request body and resubmit the request if "
        "the operation failed.",
    ),
    "PropertyValueOutOfRange": Message(
        BASE,
        "The value '%1' for the property %2 is not in the supported range of acceptable values.",
        "Warning",
        "Correct the value for the property in the request body and resubmit the request if "
        "the operation failed.",
    ),
    "PropertyValueNotInList": Message(
        BASE,
        "The value '%1' for the property %2 is not in the list of acceptable values.",
        "Warning",
        "Choose a value from the enumeration list that the implementation can support and "
        "resubmit the request if the operation failed.",
    ),
    "PropertyUnknown": Message(
        BASE,
        "The property %1 is not in the list of valid properties for the resource.",
        "Warning",
        "Remove the unknown property from the request body and resubmit the request if the "
        "operation failed.",
    ),
    "ActionParameterMissing": Message(
        BASE,
        "The action %1 requires the parameter %2 to be present in the request body.",
        "Critical",
        "Supply the action with the required parameter in the request body when the request "
        "is resubmitted.",
    ),
    "ActionParameterUnknown": Message(
        BASE,
        "The action %1 was submitted with the invalid parameter %2.",
        "Warning",
        "Correct the invalid parameter and resubmit the request if the operation failed.",
    ),
    "PropertyNotWritable": Message(
        BASE,
        "The property %1 is a read-only property and cannot be assigned a value.",
        "Warning",
        "Remove the property from the request body and resubmit the request if the operation "
        "failed.",
    ),
    "ResourceNotFound": Message(
        BASE,
        "The requested resource of type %1 named '%2' was not found.",
        "Critical",
        "Provide a valid resource identifier and resubmit the request.",
    ),
    "ResourceAlreadyExists": Message(
        BASE,
        "The requested resource of type %1 with the property %2 with the value '%3' already "
        "exists.",
        "Critical",
        "Do not repeat the create operation as the resource has already been created.",
    ),
    "ResourceInUse": Message(
        BASE,
        "The change to the requested resource failed because the resource is in use or in "
        "transition.",
        "Warning",
        "Remove the condition and resubmit the request if the operation failed.",
    ),
    "InsufficientPrivilege": Message(
        BASE,
        "There are insufficient privileges for the account or credentials associated with "
        "the current session to perform the requested operation.",
        "Critical",
        "Either abandon the operation or change the associated access rights and resubmit "
        "the request if the operation failed.",
    ),
    "NoValidSession": Message(
        BASE,
        "There is no valid session established with the implementation.",
        "Critical",
        "Establish a session before attempting any operations.",
    ),
    "PreconditionFailed": Message(
        BASE,
        "The ETag supplied did not match the ETag required to change this resource.",
        "Critical",
        "Try the operation again using the appropriate ETag.",
    ),
    "OperationNotAllowed": Message(
        BASE,
        "The HTTP method is not allowed on this resource.",
        "Critical",
        "None.",
    ),
    "ResourceCannotBeDeleted": Message(
        BASE,
        "The delete request failed because the resource requested cannot be deleted.",
        "Critical",
        "Do not attempt to delete a non-deletable resource.",
    ),
    "ServiceTemporarilyUnavailable": Message(
        BASE,
        "The service is temporarily unavailable.  Retry in %1 seconds.",
        "Critical",
        "Wait for the indicated retry duration and retry the operation.",
    ),
    "InternalError": Message(
        BASE,
        "The request failed due to an internal service error.  The service is still operational.",
        "Critical",
        "Resubmit the request.  If the problem persists, consider resetting the service.",
    ),
    "QueryNotSupported": Message(
        BASE,
        "Querying is not supported by the implementation.",
        "Warning",
        "Remove the query parameters and resubmit the request if the operation failed.",
    ),
    # Composition (DSP8011 Composition registry 1.1)
    "ResourceBlockInUse": Message(
        COMPOSITION,
        "Resource block '%1' cannot be part of any new compositions.",
        "Warning",
        "Remove the resource block from the request and resubmit the request.",
    ),
    "EmptyManifest": Message(
        COMPOSITION,
        "The provided manifest is empty or a stanza in the manifest contains no request.",
        "Warning",
        "Provide a request content for the manifest and resubmit.",
    ),
    "SpecifiedResourceAlreadyReserved": Message(
        COMPOSITION,
        "Resource block '%1' is already reserved under reservation '%2'.",
        "Critical",
        "Delete the reservation containing the resource block or select a different resource "
        "block and resubmit the request.",
    ),
    "ResourceBlockInvalid": Message(
        COMPOSITION,
        "Resource block '%1' is not valid.",
        "Critical",
        "Remove the resource block and resubmit the request.",
    ),
    "ResourceBlockNotFound": Message(
        COMPOSITION,
        "Resource block '%1' was not found.",
        "Critical",
        "Remove the resource block and resubmit the request.",
    ),
    "NoResourceMatch": Message(
        COMPOSITION,
        "The requested resources of type '%1' are not available for allocation.",
        "Critical",
        "Change parameters associated with the resource, such as quantity or performance, "
        "and resubmit the request.",
    ),
    "IncompatibleZone": Message(
        COMPOSITION,
        "The requested resource blocks span multiple resource zones.",
        "Critical",
        "Request resource blocks from the same resource zone.",
    ),
}


def message(
    name: str, *args: str, resolution: str | None = None, related: list[str] | None = None
) -> dict[str, Any]:
    """One `@Message.ExtendedInfo` entry: registry message `name` with its arguments;
    `resolution` replaces the registry's (the why-not funnel of a rejected compose)."""
    entry = MESSAGES[name]
    text = entry.text
    # An argument may come from the request (a path, a value): cut short, so that an error
    # is never many times the size of what was sent.
    args = tuple(arg if len(arg) <= MAX_ARG else f"{arg[: MAX_ARG - 3]}..." for arg in args)
    for i, arg in enumerate(args, start=1):
        text = text.replace(f"%{i}", arg)
    body: dict[str, Any] = {
        "@odata.type": "#Message.v1_3_0.Message",
        "MessageId": f"{entry.registry}.{name}",
        "Message": text,
        "MessageArgs": list(args),
        "MessageSeverity": entry.severity,
        "Resolution": resolution if resolution is not None else entry.resolution,
    }
    if related:
        body["RelatedProperties"] = related
    return body


class RedfishError(Exception):
    """An HTTP error answered with a Redfish error body."""

    def __init__(
        self,
        status: int,
        messages: list[dict[str, Any]],
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(messages[0]["Message"] if messages else str(status))
        self.status = status
        self.messages = messages
        self.headers = headers

    def body(self) -> bytes:
        first = self.messages[0] if self.messages else message("GeneralError")
        return msgspec.json.encode(
            {
                "error": {
                    "code": first["MessageId"],
                    "message": first["Message"],
                    "@Message.ExtendedInfo": self.messages,
                }
            }
        )


def error(status: int, name: str, *args: str, **kwargs: Any) -> RedfishError:
    return RedfishError(status, [message(name, *args, **kwargs)])


#: HTTP status of each engine error code (ARCHITECTURE §11).
STATUS = {
    "invalid": 400,
    "not_found": 404,
    "forbidden": 403,
    "conflict": 409,
    "quota": 409,
    "no_capacity": 400,
    "no_path": 400,
    "throttled": 429,
    "unavailable": 503,
    "failed": 500,
}


def funnel_text(details: dict[str, Any]) -> str:
    """The why-not funnel of a `no_capacity`/`no_path` rejection (engine/core/placement.py)
    as one line: each stage with the candidates it left."""
    steps = [step for step in details.get("funnel") or [] if isinstance(step, dict)]
    return ", ".join(f"{step.get('stage')}: {step.get('remaining')} left" for step in steps)


def from_engine(error_reply: dict[str, Any], kind: str = "Resource") -> RedfishError:
    """The Redfish answer to an engine rejection (`{"code", "message", "details"}`)."""
    code = error_reply.get("code", "failed")
    text = str(error_reply.get("message", ""))
    details = error_reply.get("details") or {}
    status = STATUS.get(code, 500)
    headers: tuple[tuple[str, str], ...] = ()
    if code in ("no_capacity", "no_path"):
        why = text.rstrip(".")
        funnel = funnel_text(details)
        if funnel:
            why = f"{why}. Funnel: {funnel}"
        return RedfishError(
            400,
            [
                message(
                    "NoResourceMatch",
                    kind,
                    resolution=f"{why}. Change the request's quantity, models or "
                    "constraints, or release systems, and resubmit the request.",
                )
            ],
        )
    if code in ("throttled", "unavailable"):
        retry_ms = details.get("retry_after_ms", 1000)
        seconds = str(max(1, -(-int(retry_ms) // 1000)))
        headers = (("Retry-After", seconds),)
        return RedfishError(
            status,
            [message("ServiceTemporarilyUnavailable", seconds, resolution=text or None)],
            headers,
        )
    if code == "not_found":
        return RedfishError(404, [message("ResourceNotFound", kind, str(details.get("id", "")))])
    if code == "forbidden":
        return RedfishError(403, [message("InsufficientPrivilege", resolution=text or None)])
    if code == "conflict" and "request_id" in details:
        # The engine's request_id is this service's Idempotency-Key (a request without one
        # gets a fresh id, which nothing reuses): say it in the client's terms.
        text = (
            f"Idempotency-Key {str(details['request_id'])!r} was already used with a different"
            " body; send this request under a new key."
        )
    if code in ("conflict", "quota"):
        return RedfishError(409, [message("ResourceInUse", resolution=text or None)])
    if code == "invalid":
        return RedfishError(400, [message("GeneralError", resolution=text)])
    return RedfishError(status, [message("InternalError", resolution=text or None)])
