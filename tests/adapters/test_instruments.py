"""The engine's Prometheus instruments: a registry of each engine's own, bounded labels."""

from __future__ import annotations

from trellis.adapters.instruments import EngineMetrics

COMPOSED = {"family": "intent", "verb": "compose", "code": "ok"}


def test_each_engine_counts_in_a_registry_of_its_own() -> None:
    one, two = EngineMetrics(), EngineMetrics()  # the global registry would refuse the second
    one.replied("intent", "compose", "ok", 0.01)
    assert one.registry.get_sample_value("trellis_intents_total", COMPOSED) == 1
    assert two.registry.get_sample_value("trellis_intents_total", COMPOSED) is None


def test_queries_and_views_are_counted_apart_from_intents() -> None:
    metrics = EngineMetrics()
    metrics.replied("view", "connections", "ok", 0.01)
    metrics.replied("query", "connections", "not_found", 0.01)
    queries = metrics.registry.get_sample_value
    assert queries("trellis_queries_total", {"family": "view", "verb": "connections", "code": "ok"})
    labels = {"family": "query", "verb": "connections", "code": "not_found"}
    assert queries("trellis_queries_total", labels) == 1
    assert queries("trellis_intents_total", {**labels, "family": "intent"}) is None
