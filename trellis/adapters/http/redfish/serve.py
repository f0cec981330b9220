"""Starting the Redfish service inside `trellis up` (called by adapters/bootstrap.py)."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec

from trellis.adapters.http.redfish.accounts import AccountStore
from trellis.adapters.http.redfish.service import RedfishObserver, RedfishService
from trellis.adapters.nats.foreign import Counted

ACCOUNTS_FILE = "redfish-accounts.json"


class RedfishOptions(msgspec.Struct, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    accounts: Path  # the 0600 accounts file
    admin_password: str  # `admin`'s password when the accounts file is made
    cert: Path | None = None  # TLS when both are given
    key: Path | None = None


async def serve_redfish(
    stack: contextlib.AsyncExitStack,
    nc_factory: Callable[[], Awaitable[object]],
    prefix: str,
    options: RedfishOptions,
    domains: Callable[[], Awaitable[list[str]]],
    allowed_hosts: Sequence[str] = (),
    writes: bool = True,
    tenant_connection: Callable[[str], Awaitable[object | None]] | None = None,
    on_foreign: Counted | None = None,
    observer: RedfishObserver | None = None,
) -> str:
    """Serve Redfish as `options` say (closed with `stack`); its URL.

    Raises:
        OSError: the address cannot be bound.
        ValueError: a bad admin password, or a certificate without its key.
    """
    accounts = AccountStore(options.accounts)
    accounts.ensure_admin(options.admin_password)
    context = None
    if (options.cert is None) != (options.key is None):
        raise ValueError("TLS needs both --redfish-cert and --redfish-key")
    if options.cert is not None and options.key is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(options.cert, options.key)
    nc = await nc_factory()
    stack.push_async_callback(nc.close)  # type: ignore[attr-defined]
    service = RedfishService(
        nc,  # type: ignore[arg-type]
        accounts,
        domains,
        prefix=prefix,
        host=options.host,
        port=options.port,
        allowed_hosts=allowed_hosts,
        ssl_context=context,
        writes=writes,
        tenant_connection=tenant_connection,  # type: ignore[arg-type]
        on_foreign=on_foreign,
        observer=observer,
    )
    await service.start()
    stack.push_async_callback(service.close)
    return service.url
