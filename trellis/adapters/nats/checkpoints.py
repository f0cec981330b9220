"""Signed checkpoints onto JetStream: the stream TRELLIS_CHECKPOINTS (ARCHITECTURE §3, §6).

One message per checkpoint on `<prefix>.checkpoints.<domain>`: the body is the whole C2SP
signed note (engine/core/checkpoints.py) as UTF-8 text, so a witness or auditor can check it with
the verifier key alone; `Nats-Msg-Id` is `<domain>/<size>` (a checkpoint published again is
dropped as a duplicate), and the headers `Trellis-Domain` and `Trellis-Size` say what it is
without parsing. The stream keeps every checkpoint (file storage, no age or size limit: a
checkpoint is a few hundred bytes, one per thousand events by default) on
`StreamLimits.replicas` servers. Its name follows the event stream's (adapters/nats/jetstream.py):
`TRELLIS_CHECKPOINTS`, or `TRELLIS_CHECKPOINTS_<prefix>` for another subject prefix.
"""

from __future__ import annotations

import dataclasses

from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from trellis.adapters.nats.jetstream import (
    DEFAULT_PREFIX,
    DUPLICATE_WINDOW_S,
    StreamConfigError,
    checkpoint_stream_name,
)

PUBLISH_TIMEOUT_S = 5.0


def checkpoint_subject(prefix: str, domain: str) -> str:
    return f"{prefix}.checkpoints.{domain}"


class CheckpointPublisher:
    """Publishes signed checkpoints to the stream (adapters/postgres/checkpoints.py `Publish`).

    Args:
        nc: a NATS connection (the relay's own will do).
        prefix: the subject prefix; also decides the stream name.
        replicas: on how many JetStream servers the stream is kept.
    """

    def __init__(
        self,
        nc: NATS,
        *,
        prefix: str = DEFAULT_PREFIX,
        replicas: int = 1,
        timeout: float = PUBLISH_TIMEOUT_S,
    ):
        self.prefix = prefix
        self.stream = checkpoint_stream_name(prefix)
        self._js = nc.jetstream()
        self._replicas = replicas
        self._timeout = timeout
        self._ready = False

    async def prepare(self) -> None:
        """Create the stream, or bring its replicas in line.

        Raises:
            StreamConfigError: a stream of that name carries other subjects, or JetStream
                refuses the replicas.
        """
        subjects = [f"{self.prefix}.checkpoints.>"]
        wanted = StreamConfig(
            name=self.stream,
            description="Trellis signed Merkle checkpoints (adapters/nats/checkpoints.py)",
            subjects=subjects,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=self._replicas,
        )
        try:
            try:
                have = (await self._js.stream_info(self.stream)).config
            except NotFoundError:
                await self._js.add_stream(wanted)
            else:
                if have.subjects != subjects:
                    raise StreamConfigError(
                        f"stream {self.stream} carries {have.subjects}, not {subjects}: another "
                        "subject prefix maps to the same stream name, or it was made by hand"
                    )
                if have.num_replicas != self._replicas:
                    changed = dataclasses.replace(have, num_replicas=self._replicas)
                    await self._js.update_stream(changed)
        except APIError as exc:
            raise StreamConfigError(
                f"JetStream refused stream {self.stream} with {self._replicas} replica(s) "
                f"(TRELLIS_JS_REPLICAS): {exc.description}"
            ) from exc
        self._ready = True

    async def __call__(self, domain: str, size: int, note: str) -> None:
        """Publish one checkpoint and wait for the stream's acknowledgement."""
        if not self._ready:
            await self.prepare()
        await self._js.publish(
            checkpoint_subject(self.prefix, domain),
            note.encode(),
            timeout=self._timeout,
            stream=self.stream,
            headers={
                "Nats-Msg-Id": f"{domain}/{size}",
                "Trellis-Domain": domain,
                "Trellis-Size": str(size),
            },
        )
