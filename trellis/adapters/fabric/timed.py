"""A FabricDriver that times every call of the driver it wraps (the fabric operation metric).

The engine sees a FabricDriver like any other; each call is reported to `observe` with its
operation name, its outcome and its duration. Outcomes: `ok`, `error` (the driver raised) and
`abandoned` (the caller gave up waiting: the saga's deadline, or a stop).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from trellis.engine.core.fabric import FabricBinding, FabricChange, FabricCircuit, FabricSnapshot
from trellis.engine.service.ports import FabricDriver

T = TypeVar("T")
#: observe(operation, outcome, seconds)
Observe = Callable[[str, str, float], None]


class TimedFabric:
    """Wraps `driver`; every call goes through to it unchanged and is timed."""

    def __init__(self, driver: FabricDriver, observe: Observe):
        self.driver = driver
        self._observe = observe

    async def create_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        await self._timed(
            "create_circuit", self.driver.create_circuit(domain, circuit, fence=fence)
        )

    async def remove_circuit(
        self, domain: str, circuit: FabricCircuit, *, fence: int | None = None
    ) -> None:
        await self._timed(
            "remove_circuit", self.driver.remove_circuit(domain, circuit, fence=fence)
        )

    async def bind(self, domain: str, binding: FabricBinding, *, fence: int | None = None) -> None:
        await self._timed("bind", self.driver.bind(domain, binding, fence=fence))

    async def unbind(
        self, domain: str, binding: FabricBinding, *, fence: int | None = None
    ) -> None:
        await self._timed("unbind", self.driver.unbind(domain, binding, fence=fence))

    async def snapshot(self, domain: str, *, fence: int | None = None) -> FabricSnapshot:
        return await self._timed("snapshot", self.driver.snapshot(domain, fence=fence))

    async def program(
        self,
        domain: str,
        changes: Sequence[FabricChange],
        *,
        fence: int | None = None,
        started: Callable[[FabricChange], None] | None = None,
    ) -> None:
        await self._timed(
            "program", self.driver.program(domain, changes, fence=fence, started=started)
        )

    async def _timed(self, operation: str, call: Awaitable[T]) -> T:
        started = time.perf_counter()
        outcome = "abandoned"  # unless it returns or raises: cancelled
        try:
            result = await call
            outcome = "ok"
            return result
        except Exception:
            outcome = "error"
            raise
        finally:
            self._observe(operation, outcome, time.perf_counter() - started)
