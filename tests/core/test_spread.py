"""Domains spread over engines (engine/core/spread.py): the same answer everywhere, balanced
within one, few moves when engines come and go, and an operator's cap kept."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from trellis.engine.core.spread import spread

DOMAINS = [f"hall-{i:02}" for i in range(24)]


def engines(n: int) -> list[str]:
    return [f"e-{i:012x}" for i in range(n)]


def loads(placed: dict[str, str], names: list[str]) -> list[int]:
    counted = Counter(placed.values())
    return [counted[e] for e in names]


@pytest.mark.parametrize("n_domains", [0, 1, 7, 24, 25, 100])
@pytest.mark.parametrize("n_engines", [1, 2, 3, 4, 7])
def test_every_domain_is_placed_and_every_engine_is_within_one_of_the_others(
    n_domains: int, n_engines: int
) -> None:
    domains, names = [f"d{i}" for i in range(n_domains)], engines(n_engines)
    placed = spread(domains, names)
    assert sorted(placed) == sorted(domains)
    counts = loads(placed, names)
    assert max(counts) - min(counts) <= 1, counts


def test_every_engine_computes_the_same_placement_whatever_order_it_learned_things_in() -> None:
    names = engines(4)
    first = spread(DOMAINS, names)
    for seed in range(5):
        shuffled_domains, shuffled_engines = DOMAINS[:], names[:]
        random.Random(seed).shuffle(shuffled_domains)
        random.Random(seed + 100).shuffle(shuffled_engines)
        assert spread(shuffled_domains, shuffled_engines) == first


def test_an_engine_that_joins_or_leaves_moves_few_domains() -> None:
    three, four = engines(3), engines(4)
    before = spread(DOMAINS, three)
    joined = spread(DOMAINS, four)
    moved = [d for d in DOMAINS if before[d] != joined[d]]
    # The newcomer's share (6 of 24) must move to it; a little more is the price of balance.
    assert sum(joined[d] == four[3] for d in DOMAINS) == 6
    assert len(moved) <= 9, moved
    left = spread(DOMAINS, [e for e in four if e != four[1]])
    moved = [d for d in DOMAINS if joined[d] != left[d]]
    # What the leaver held must move (6); again a little more at most.
    assert {d for d in DOMAINS if joined[d] == four[1]} <= set(moved)
    assert len(moved) <= 9, moved


def test_a_cap_bounds_every_engine_and_the_rest_of_the_domains_have_no_place() -> None:
    names = engines(3)
    placed = spread(DOMAINS, names, cap=5)
    assert loads(placed, names) == [5, 5, 5]
    assert len(placed) == 15
    # A cap above the balanced share changes nothing.
    assert spread(DOMAINS, names, cap=9) == spread(DOMAINS, names)


def test_no_engines_place_nothing() -> None:
    assert spread(DOMAINS, []) == {}
