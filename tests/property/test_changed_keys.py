"""The relay's map diff, compiled and reference, agree on maps changed as `evolve` changes them:
copies that share the entries they did not touch."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from path_cores import compiled

from trellis.ext import _diff_py


@pytest.fixture(params=["python", "cython"])
def changed_keys(request: pytest.FixtureRequest) -> Any:
    if request.param == "python":
        return _diff_py.changed_keys
    return compiled("_diff_c").changed_keys


class Entry:
    """A state entry: compared by its value, never hashed (state entries need not be)."""

    def __init__(self, value: int):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


# An edit: drop a key, replace its entry with a new object of some value (equal to the old
# one or not), add a key, or put back the entry the key held before (no change).
edits = st.lists(
    st.tuples(
        st.sampled_from(["drop", "replace", "add", "restore"]),
        st.integers(0, 40),
        st.integers(0, 3),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 40), edits=edits)
def test_both_find_exactly_the_keys_whose_entry_changed(size: int, edits: list[Any]) -> None:
    before: dict[Any, Any] = {f"k{i}": Entry(i % 4) for i in range(size)}
    after = dict(before)
    for edit, i, value in edits:
        key = f"k{i}"
        if edit == "drop":
            after.pop(key, None)
        elif edit in ("replace", "add"):
            after[key] = Entry(value)
        elif key in before:
            after[key] = before[key]
    expected = {
        k
        for k in before.keys() | after.keys()
        if k not in before or k not in after or before[k] != after[k]
    }
    assert _diff_py.changed_keys(before, after) == expected
    assert compiled("_diff_c").changed_keys(before, after) == expected


def test_the_same_map_and_empty_maps(changed_keys: Any) -> None:
    shared = {"a": Entry(1)}
    assert changed_keys(shared, shared) == set()
    assert changed_keys({}, {}) == set()
    assert changed_keys({}, {"a": None}) == {"a"}
    assert changed_keys({"a": None}, {}) == {"a"}


def test_an_entry_rebuilt_equal_did_not_change(changed_keys: Any) -> None:
    before = {"a": Entry(1), "b": Entry(2), "c": 0.5}
    after = {"a": Entry(1), "b": Entry(3), "c": 0.25 + 0.25}
    assert changed_keys(before, after) == {"b"}


def test_a_none_entry_is_an_entry(changed_keys: Any) -> None:
    # The reference reads a missing key as None: a None entry must not pass for a missing one.
    assert changed_keys({"a": None, "b": None}, {"a": None}) == {"b"}
    assert changed_keys({"a": None}, {"a": None, "b": None}) == {"b"}
    assert changed_keys({"a": None}, {"a": 0}) == {"a"}


def test_keys_need_not_be_text(changed_keys: Any) -> None:
    before = {1: "x", (2, 3): "y"}
    assert changed_keys(before, {**before, (2, 3): "z", 4: "w"}) == {(2, 3), 4}


def test_an_entry_that_cannot_be_compared_raises(changed_keys: Any) -> None:
    class Broken:
        def __ne__(self, other: object) -> bool:
            raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        changed_keys({"a": Broken()}, {"a": Broken()})
