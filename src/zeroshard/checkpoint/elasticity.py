"""DeepSpeed's elasticity API next to the checkpoint code that makes an elastic restart work.

The algorithm is batch arithmetic and lives in `zeroshard.config.elasticity` (the config layer applies
it at initialize: [Note: elasticity at initialize]); a restart on another valid world size loads
`latest` through resharding (checkpoint/reshard.py) with the global batch the block fixes.
"""

from zeroshard.config.elasticity import (
    ElasticBatch,
    ElasticConfig,
    ElasticityError,
    apply_elasticity,
    compute_elastic_config,
    elastic_batch_sizes,
    get_compatible_gpus_v01,
    get_compatible_gpus_v02,
)

__all__ = [
    "ElasticBatch",
    "ElasticConfig",
    "ElasticityError",
    "apply_elasticity",
    "compute_elastic_config",
    "elastic_batch_sizes",
    "get_compatible_gpus_v01",
    "get_compatible_gpus_v02",
]
