"""`zeroshard estimate`: per-rank memory of each ZeRO stage and offload choice, and a recommendation.

    >>> from zeroshard.cli.estimate import Cluster, Precision, estimate_rows
    >>> from zeroshard.cli.estimate.shapes import from_params
    >>> rows = estimate_rows(from_params(7e9), Cluster(gpus_per_node=8), Precision(), seq_len=2048, micro_batch=1)
    >>> [r.option.label() for r in rows][:3]
    ['stage 0', 'stage 1', 'stage 1, offload_optimizer=cpu']

Modules: formulas (model states: zeroshard's and DeepSpeed's accounting), activations, shapes
(parameter count and shape from a config), rows (one row per option), recommend (the decision tree),
command (argument parsing and output).
"""

from zeroshard.cli.estimate.formulas import OPTIONS, Cluster, ModelStates, Option, Precision, zeroshard_states
from zeroshard.cli.estimate.recommend import Recommendation, recommend
from zeroshard.cli.estimate.rows import Row, estimate_rows

__all__ = [
    "OPTIONS",
    "Cluster",
    "ModelStates",
    "Option",
    "Precision",
    "Recommendation",
    "Row",
    "estimate_rows",
    "recommend",
    "zeroshard_states",
]
