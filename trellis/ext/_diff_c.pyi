from collections.abc import Hashable
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)

def changed_keys(before: dict[K, Any], after: dict[K, Any]) -> set[K]: ...
