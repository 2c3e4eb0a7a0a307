"""How much free disk the NVMe tiers ask for before any work (`zero.from_config._nvme_bytes`): per element this
rank trains, master and two moments in their dtypes and (stage 3) the gradient shard; frozen parameters none."""

from __future__ import annotations

from torch import nn

from zeroshard.config import parse_config, resolve_config
from zeroshard.precision.policy import PrecisionPolicy
from zeroshard.zero.from_config import SWAP_ALIGN, _nvme_bytes

WORLD = 4
OPT, PARAM = 4 * SWAP_ALIGN * 2, SWAP_ALIGN * 2  # each swap file's rounding: 2 parameter tensors


def _need(stage: int, model: nn.Module, **extra: object) -> dict[str, int]:
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/opt_swap"},
            **({"offload_param": {"device": "nvme", "nvme_path": "/param_swap"}} if stage == 3 else {}),
        },
        **extra,
    }
    cfg = resolve_config(parse_config(raw), world_size=WORLD)
    return _nvme_bytes(cfg, model, WORLD, PrecisionPolicy.from_config(cfg))


def _model(frozen: bool) -> nn.Module:
    model = nn.Sequential(nn.Linear(100, 100, bias=False), nn.Linear(100, 100, bias=False))  # 10,000 each
    model[0].weight.requires_grad_(not frozen)
    return model


def test_full_training_counts_master_moments_and_stage_3_gradients() -> None:
    shard = 20_000 / WORLD
    assert _need(3, _model(False)) == {
        "/opt_swap": int(1.25 * 16 * shard) + OPT,
        "/param_swap": int(1.25 * 4 * shard) + PARAM,
    }
    assert _need(2, _model(False)) == {
        "/opt_swap": int(1.25 * 12 * shard) + OPT
    }  # stages 1-2: gradients stay in memory
    bf16 = {"bf16": {"enabled": True}}
    assert _need(3, _model(False), **bf16) == {
        "/opt_swap": int(1.25 * 16 * shard) + OPT,
        "/param_swap": int(1.25 * 2 * shard) + PARAM,
    }
    both = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    assert _need(3, _model(False), **both)["/opt_swap"] == int(1.25 * (2 + 4 + 4) * shard) + OPT
    masters = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}  # fp32 moments over bf16 masters
    assert _need(3, _model(False), **masters)["/opt_swap"] == int(1.25 * (2 + 8 + 4) * shard) + OPT


def test_frozen_parameters_need_no_optimizer_swap_space() -> None:
    """Half the model frozen: every stage spreads the 5,000 trainable elements over the ranks (2,500 per rank; stage
    3 splits each unit's trainable section evenly). Before, both budgeted the optimizer for every parameter, frozen
    ones too. The parameter shards are all there."""
    assert _need(3, _model(True)) == {
        "/opt_swap": int(1.25 * 16 * 2_500) + OPT,
        "/param_swap": int(1.25 * 4 * 5_000) + PARAM,
    }
    assert _need(2, _model(True)) == {"/opt_swap": int(1.25 * 12 * 2_500) + OPT}
