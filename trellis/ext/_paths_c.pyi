from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import networkx as nx

from ._live_c import LiveConditions
from ._paths_py import Conditions, DeviceInfo, LinkInfo, NodeInfo, Path, PathRequest, Selector

def hop_distances(
    indptr: Sequence[int], indices: Sequence[int], source: int, max_hops: int
) -> list[int]: ...

class Fabric:
    node_ids: tuple[str, ...]
    link_ids: tuple[str, ...]
    ports: dict[str, dict[int, LinkInfo]]
    devices: dict[str, DeviceInfo]
    last_rounds: int  # label-setting searches the last query on this fabric ran
    def __init__(
        self,
        nodes: Mapping[str, NodeInfo],
        links: Iterable[LinkInfo],
        devices: Mapping[str, DeviceInfo] | None = None,
    ) -> None: ...
    def kind(self, node: str) -> str: ...
    @property
    def graph(self) -> nx.MultiGraph: ...

def best_paths(
    fabric: Fabric,
    conditions: Conditions | LiveConditions | Any,
    request: PathRequest,
    targets: AbstractSet[str],
) -> dict[str, Path]: ...
def best_costs(
    fabric: Fabric,
    conditions: Conditions | LiveConditions | Any,
    request: PathRequest,
    targets: AbstractSet[str] | Selector,
) -> dict[str, tuple[int, int]]: ...
def reachable(
    fabric: Fabric,
    conditions: Conditions | LiveConditions | Any,
    request: PathRequest,
    targets: AbstractSet[str] | Selector,
) -> int: ...
def census(
    fabric: Fabric, conditions: Conditions | LiveConditions | Any, selector: Selector
) -> tuple[int, int, int, int]: ...
