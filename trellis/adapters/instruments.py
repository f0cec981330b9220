"""The Prometheus instruments of one engine (docs/operations.md: Metrics names each one).

`EngineMetrics` holds a registry of its own, never prometheus-client's global default one, so
several engines in one process (the tests) keep separate counts. It is the engine's Telemetry
(engine/service/ports.py: decisions, group commits, saga outcomes), the intake's request observer
(every answer by family, verb and reply code, and how long it took) and the timed fabric's observer
(adapters/fabric/timed.py). Gauges of state (devices free and used, utilization, compositions
by state, components out of use, how far the projections and the relay trail the log) are read
from the engine when scraped, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from trellis.engine.core.ids import is_valid_id
from trellis.engine.core.intents import INTENTS
from trellis.engine.core.state import (
    Component,
    CompositionState,
    DomainState,
    NodeState,
    usable,
)
from trellis.engine.service.follower import Followers
from trellis.engine.service.ports import DropReason, SagaOutcome
from trellis.engine.service.router import Engine

log = logging.getLogger(__name__)

# Labels take only values from these sets, so a client sending made-up verbs cannot grow the
# number of series without bound; anything else is counted as "other".
WRITE_FAMILIES = ("intent", "admin")
_KNOWN_VERBS = {(family, verb) for family, verb in INTENTS} | {
    ("view", verb) for family, verb in INTENTS if family == "query"
}
OTHER = "other"
_MEMORY = "memory"
# A memory pool with less than this many GiB unsliced has none left (as the `free` query says).
_NO_GIB = 1e-9
# The states of a live composition (released and failed ones leave the state): each is reported
# per domain, 0 too, so an alert on impaired ones has a series to read before the first one.
_LIVE: tuple[CompositionState, ...] = ("pending", "active", "impaired")
# Why a component carries no paths: its health, or (healthy) a drain.
_UNUSABLE = ("failed", "degraded", "drained")

# Seconds: decisions take microseconds, commits and replies milliseconds, and a compose is
# answered only once its fabric saga settled (up to the saga deadline, 10 s by default).
_DECIDE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1, 1.0)
_LATENCY_BUCKETS = (
    5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Requests per group commit: the writer takes at most 256 at a time (engine.service.writer).
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """One engine's instruments and the registry that exposes them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.intents = Counter(
            "trellis_intents",
            "Intents and admin verbs answered, by family, verb and reply code (ok or the error).",
            ["family", "verb", "code"],
            registry=registry,
        )
        self.queries = Counter(
            "trellis_queries",
            "Queries and tenant views answered, by family, verb and reply code.",
            ["family", "verb", "code"],
            registry=registry,
        )
        self.dropped_requests = Counter(
            "trellis_requests_dropped",
            "Requests dropped unanswered, by family: their reply subject was not the "
            "requester's inbox (ARCHITECTURE §3), so nothing was decided or written.",
            ["family"],
            registry=registry,
        )
        self.foreign_messages = Counter(
            "trellis_foreign_messages",
            "Messages of the event stream or the state bucket that are not the contract's "
            "(not an event of the log, not a value of the bucket), skipped by `consumer` while "
            "reading `domain` (ARCHITECTURE §3).",
            ["consumer", "domain"],
            registry=registry,
        )
        self.redfish_answers = Counter(
            "trellis_redfish_requests",
            "Requests the northbound Redfish service answered, by method and HTTP status "
            "(a stream of events counts as 200 when it opens).",
            ["method", "status"],
            registry=registry,
        )
        self.redfish_logins_refused = Counter(
            "trellis_redfish_logins_refused",
            "Redfish requests refused for who sent them, by reason: `credentials` (a wrong "
            "user name or password), `session` (an unknown or ended X-Auth-Token) or "
            "`throttled` (an address past its budget of failed logins, answered 429 without a "
            "password check).",
            ["reason"],
            registry=registry,
        )
        self.reply_seconds = Histogram(
            "trellis_reply_seconds",
            "From receiving a request to sending its reply (a compose: after its saga settled).",
            ["family", "verb"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.decide_seconds = Histogram(
            "trellis_decide_seconds",
            "Deciding one intent (the pure decide step), by verb.",
            ["verb"],
            buckets=_DECIDE_BUCKETS,
            registry=registry,
        )
        self.commit_seconds = Histogram(
            "trellis_commit_seconds",
            "One group commit: a batch's events and request ids in one Postgres transaction.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_requests = Histogram(
            "trellis_group_commit_requests",
            "Requests decided together and committed in one transaction.",
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.saga_outcomes = Counter(
            "trellis_saga_outcomes",
            "Compose sagas settled: established (active or impaired) or failed (undone).",
            ["outcome"],
            registry=registry,
        )
        self.domains_dropped = Counter(
            "trellis_domains_dropped",
            "Domains this engine stopped writing, by reason: stopping (its own stop), "
            "lease_lost (a renewal refused), handed_over (to the engine placement prefers), "
            "lease_ran_out (paused past its lease), fenced (the log or the fabric refused "
            "its epoch). Anything but stopping: the domain was taken from it (another "
            "engine, or this one again under a newer epoch, writes it now).",
            ["reason"],
            registry=registry,
        )
        self.domains_taken = Counter(
            "trellis_domains_taken",
            "Domains this engine began writing (under a new writer lease epoch).",
            registry=registry,
        )
        self.fabric_seconds = Histogram(
            "trellis_fabric_operation_seconds",
            "One call of the fabric driver, by operation and outcome (ok, error, abandoned).",
            ["operation", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    # ---- the engine's Telemetry (engine/service/ports.py) ----

    def decided(self, verb: str, seconds: float) -> None:
        self.decide_seconds.labels(verb).observe(seconds)

    def committed(self, domain: str, requests: int, seconds: float) -> None:
        self.commit_seconds.observe(seconds)
        self.batch_requests.observe(requests)

    def settled(self, domain: str, outcome: SagaOutcome) -> None:
        self.saga_outcomes.labels(outcome).inc()

    def began_writing(self, domain: str, epoch: int) -> None:
        self.domains_taken.inc()

    def stopped_writing(self, domain: str, reason: DropReason) -> None:
        self.domains_dropped.labels(reason).inc()

    # ---- the intake's observer (adapters/nats/intake.py) ----

    def replied(self, family: str, verb: str, code: str, seconds: float) -> None:
        """A request of `family` and `verb` was answered with `code` ("ok" or the error's)."""
        if (family, verb) not in _KNOWN_VERBS:
            verb = OTHER
        counter = self.intents if family in WRITE_FAMILIES else self.queries
        counter.labels(family, verb, code).inc()
        self.reply_seconds.labels(family, verb).observe(seconds)

    def dropped(self, family: str) -> None:
        """A request of `family` was dropped unanswered (its reply subject is no inbox)."""
        self.dropped_requests.labels(family).inc()

    def foreign_message(self, consumer: str, domain: str) -> None:
        """`consumer` skipped a message of the stream or the bucket that is not the contract's."""
        self.foreign_messages.labels(consumer, domain).inc()

    def redfish_answered(self, method: str, status: int) -> None:
        self.redfish_answers.labels(method, str(status)).inc()

    def redfish_login_refused(self, reason: str) -> None:
        self.redfish_logins_refused.labels(reason).inc()

    def follower_counted(self, name: str, labels: tuple[str, ...], grew: int) -> None:
        """The follower process's counter `name` of `labels` grew by `grew` (its report,
        adapters/follow_process.py): counted here as the inline followers count it. Only the
        counters it keeps, with labels as they name them: a report cannot add series."""
        if name == "trellis_foreign_messages" and len(labels) == 2:
            consumer, domain = labels
            if consumer == "relay" and is_valid_id(domain):
                self.foreign_messages.labels(consumer, domain).inc(grew)
                return
        log.warning("the follower process reported an unknown counter %s%s", name, labels)

    # ---- the timed fabric's observer (adapters/fabric/timed.py) ----

    def fabric_operation(self, operation: str, outcome: str, seconds: float) -> None:
        self.fabric_seconds.labels(operation, outcome).observe(seconds)

    def watch(self, engine: Engine, followers: Followers, *, projections: str, relay: str) -> None:
        """Report `engine`'s devices and how far the follower sinks named `projections` and
        `relay` trail its log, each time the registry is scraped."""
        self.registry.register(_StateGauges(engine, followers, projections, relay))


class _StateGauges(Collector):
    """Gauges computed from the engine's state when scraped: every domain this engine writes."""

    def __init__(self, engine: Engine, followers: Followers, projections: str, relay: str):
        self._engine = engine
        self._followers = followers
        self._lags = (
            (projections, "trellis_projection_lag_positions", "projections"),
            (relay, "trellis_relay_lag_positions", "the event relay (JetStream stream and KV)"),
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Known up front: registering must not read the engine (it may not have started).
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        free, used, utilization, compositions, unusable, written, epochs, *lags = families
        count = 0
        for domain in self._engine.domains:
            state, head = self._engine.state(domain), self._engine.head(domain)
            if state is None or head is None:
                continue  # dropped since `domains` was read
            count += 1
            epoch = self._engine.fence(domain)
            if epoch is not None:
                epochs.add_metric([domain], epoch)
            _devices(domain, state, free, used, utilization)
            _fabric_faults(domain, state, compositions, unusable)
            for (sink, _, _), gauge in zip(self._lags, lags, strict=True):
                follower = self._followers.of(sink, domain)
                if follower is not None:
                    gauge.add_metric([domain], max(0, head.position - follower.position))
        written.add_metric([], count)
        return iter(families)

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "trellis_devices_free",
                "Usable devices nobody holds (memory pools: with GiB left), by kind and model.",
                labels=["domain", "kind", "model"],
            ),
            GaugeMetricFamily(
                "trellis_devices_used",
                "Devices a live composition holds (memory pools: any slice), by kind and model.",
                labels=["domain", "kind", "model"],
            ),
            GaugeMetricFamily(
                "trellis_device_utilization",
                "Used over usable, per kind: usable devices held / usable devices (memory: GiB "
                "held / GiB of usable pools).",
                labels=["domain", "kind"],
            ),
            GaugeMetricFamily(
                "trellis_compositions",
                "Live compositions by state: pending (its saga runs), active, impaired (a "
                "component on its paths failed, degraded or was drained and no repair avoided "
                "it yet).",
                labels=["domain", "state"],
            ),
            GaugeMetricFamily(
                "trellis_components_unusable",
                "Components that carry no paths, by kind (host, switch, ocs, link, or a "
                "device's kind) and state (failed, degraded, or drained while healthy).",
                labels=["domain", "kind", "state"],
            ),
            GaugeMetricFamily(
                "trellis_domains_written",
                "Domains this engine writes now (each written by one engine at a time).",
            ),
            GaugeMetricFamily(
                "trellis_writer_epoch",
                "The writer lease epoch this engine writes the domain under: it grows each "
                "time the domain changes hands (a takeover, a hand-over, a restart).",
                labels=["domain"],
            ),
            *(
                GaugeMetricFamily(
                    name,
                    f"Log positions between the domain's last event and what {what} applied.",
                    labels=["domain"],
                )
                for _, name, what in self._lags
            ),
        ]


def _fabric_faults(
    domain: str,
    state: DomainState,
    compositions: GaugeMetricFamily,
    unusable: GaugeMetricFamily,
) -> None:
    """Add one domain's live compositions by state, and its unusable components, to the
    gauges. Every live state is reported, 0 too, and every state of each kind the domain has
    (a handful of series): an alert or a graph has a series to read before the first fault."""
    by_state = Tally(composition.state for composition in state.compositions.values())
    for name in _LIVE:
        compositions.add_metric([domain, name], by_state[name])
    kinds: set[str] = set()
    out: Tally[tuple[str, str]] = Tally()
    components: list[tuple[str, Component]] = [
        *((_kind(node), node) for node in state.nodes.values()),
        *(("link", link) for link in state.links.values()),
    ]
    for kind, component in components:
        kinds.add(kind)
        if not usable(component):
            out[kind, _why_unusable(component)] += 1
    for kind in sorted(kinds):
        for why in _UNUSABLE:
            unusable.add_metric([domain, kind, why], out[kind, why])


def _kind(node: NodeState) -> str:
    """A node's kind as the gauges name it: a device by its kind (gpu, memory, ...)."""
    spec = node.spec
    return spec.device_kind if spec.kind == "device" and spec.device_kind else spec.kind


def _why_unusable(component: Component) -> str:
    """An unusable component's state: its health, or, healthy, that it is drained."""
    return "drained" if component.health == "healthy" else component.health


def _devices(
    domain: str,
    state: DomainState,
    free: GaugeMetricFamily,
    used: GaugeMetricFamily,
    utilization: GaugeMetricFamily,
) -> None:
    """Add one domain's device counts and utilization to the gauges."""
    free_count: Tally[tuple[str, str]] = Tally()
    used_count: Tally[tuple[str, str]] = Tally()
    usable_amount: defaultdict[str, float] = defaultdict(float)  # per kind: devices (memory: GiB)
    held_amount: defaultdict[str, float] = defaultdict(float)
    for device_id, node in state.nodes.items():
        spec = node.spec
        if spec.kind != "device" or spec.device_kind is None:
            continue
        kind: str = spec.device_kind
        model = (kind, spec.model or "")
        whole = 1.0 if kind != _MEMORY else spec.capacity_gib or 0.0
        if device_id in state.device_owner:  # a memory pool asked for by id is held whole
            held = whole
        else:
            held = state.memory_used.get(device_id, 0.0) if kind == _MEMORY else 0.0
        used_count[model] += held > _NO_GIB
        free_count[model] += usable(node) and whole - held > _NO_GIB
        if usable(node):
            usable_amount[kind] += whole
            held_amount[kind] += held
    for key in sorted(free_count.keys() | used_count.keys()):
        free.add_metric([domain, *key], free_count[key])
        used.add_metric([domain, *key], used_count[key])
    for kind, amount in sorted(usable_amount.items()):
        if amount > 0:
            utilization.add_metric([domain, kind], held_amount[kind] / amount)
