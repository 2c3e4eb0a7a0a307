"""How layers are split into stages: pure functions of layer weights, as DeepSpeed's `partition_method`s.

The result is the stage boundaries `parts` (length num_stages + 1): stage s runs layers parts[s]:parts[s + 1].
The same algorithms as DeepSpeed's `runtime/utils.py` (`partition_uniform`, `partition_balanced`), so a model
is split at the same layers under both libraries.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal counts; the first `num_items % num_parts` parts take one more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts whose weight sums are as even as possible: the smallest spread between the heaviest and
    the lightest part (the linear partition problem by dynamic programming; ties go to the later split)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    best_max = [[inf] * (m + 1) for _ in range(n + 1)]
    best_min = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    best_max[0][0] = 0.0
    cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(best_max[k][j - 1], part), min(best_min[k][j - 1], part)
                if cost[i][j] >= hi - lo:
                    cost[i][j], best_max[i][j], best_min[i][j], position[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def type_weights(names: Sequence[str], pattern: str) -> list[int]:
    """`partition_method="type:<regex>"`: weight 1 for layers whose class name matches (case-insensitive)."""
    regex = re.compile(pattern, re.IGNORECASE)
    return [1 if regex.search(name) else 0 for name in names]


def partition(method: str, param_counts: Sequence[int], names: Sequence[str], num_stages: int) -> list[int]:
    """Stage boundaries for `partition_method` ("uniform", "parameters" or "type:<regex>")."""
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(names), num_stages)
    if method == "parameters":
        return partition_balanced(param_counts, num_stages)
    if method.startswith("type:"):
        return partition_balanced(type_weights(names, method.split(":", 1)[1]), num_stages)
    raise NotImplementedError(
        f'partition_method={method!r}: expected "uniform", "parameters" or "type:<regex>" ("profile" is not '
        "implemented, as in DeepSpeed)"
    )
