"""The ds_config -> FSDP2 mapping ([Note: fsdp2 mapping]) and its refusals, without a process group."""

from __future__ import annotations

import pytest
import torch

from zeroshard.config import parse_config, resolve_config
from zeroshard.errors import ConfigError
from zeroshard.fsdp2.params import row_range
from zeroshard.fsdp2.plan import plan_from_config, unused_keys


def _cfg(stage: int = 3, **zero: object) -> object:
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "zeroshard": {"backend": "fsdp2"},
        "zero_optimization": {"stage": stage, **zero},
    }
    return resolve_config(parse_config(raw), world_size=2)


def test_stages_map_to_reshard_after_forward():
    assert plan_from_config(_cfg(3), torch.float32).reshard_after_forward is True
    assert plan_from_config(_cfg(2), torch.float32).reshard_after_forward is False


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_and_1_are_refused_suggesting_stage_2_or_the_zero_backend(stage):
    with pytest.raises(ConfigError, match=r"stage 2.*\"zero\" backend"):
        plan_from_config(_cfg(stage), torch.float32)


def test_mixed_precision_reduces_in_fp32_unless_told():
    plan = plan_from_config(_cfg(3), torch.bfloat16)
    assert (plan.param_dtype, plan.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert plan_from_config(_cfg(3), torch.float32).param_dtype is None
    told = resolve_config(
        parse_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "communication_data_type": "bf16",
                "zero_optimization": {"stage": 3},
            }
        ),
        world_size=2,
    )
    assert plan_from_config(told, torch.bfloat16).reduce_dtype == torch.bfloat16


def test_cpu_offload_is_all_or_nothing():
    plan = plan_from_config(
        _cfg(3, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}), torch.float32
    )
    assert plan.cpu_offload
    for key in ("offload_param", "offload_optimizer"):
        with pytest.raises(ConfigError, match=r"offload_param\.device.*offload_optimizer\.device"):
            plan_from_config(_cfg(3, **{key: {"device": "cpu"}}), torch.float32)


def test_partial_offload_is_refused_before_any_work():
    """In resolve_config, which `zeroshard validate-config` and `initialize` share."""
    offload = {"device": "cpu", "ratio": 0.5}
    with pytest.raises(ConfigError, match=r"offload_optimizer\.ratio: 0\.5 .*\"zero\" backend"):
        _cfg(3, offload_param={"device": "cpu"}, offload_optimizer=offload)


def test_nvme_is_refused():
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    with pytest.raises(ConfigError, match="NVMe"):
        plan_from_config(_cfg(3, offload_optimizer=nvme), torch.float32)


def test_backend_key_defaults_to_zero_and_is_checked():
    assert resolve_config(parse_config({"train_micro_batch_size_per_gpu": 1}), world_size=1).zeroshard.backend == "zero"
    with pytest.raises(ConfigError, match="zeroshard.backend"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "zeroshard": {"backend": "fsdp"}})


def test_initialize_backend_argument_is_checked():
    import zeroshard

    with pytest.raises(ConfigError, match="backend"):
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1}, backend="ddp")


def test_row_ranges_follow_torch_chunk():
    for dim0 in (1, 5, 8, 33):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(dim0).chunk(world)
            for rank in range(world):
                lo, hi = row_range(dim0, world, rank)
                expected = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(lo, hi)) == expected, (dim0, world, rank)


@pytest.mark.parametrize(
    "key, value",
    [
        ("zero_quantized_weights", True),
        ("zero_hpz_partition_size", 2),
        ("zero_quantized_gradients", True),
        ("zero_quantized_nontrainable_weights", True),
    ],
)
def test_zeropp_keys_are_refused_naming_the_key(key: str, value: object) -> None:
    """FSDP2's collectives are its own: a ZeRO++ key would be accepted and do nothing."""
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key} \(ZeRO\+\+\) needs the \"zero\" backend"):
        plan_from_config(_cfg(3, **{key: value}), torch.float32)


def test_the_zero_backends_tuning_keys_are_named_as_unused() -> None:
    """The engine logs these in one warning line: before, the fsdp2 backend dropped them without a word (a bf16
    grad_accum_dtype too, where the zero backend accumulates in bf16)."""
    raw = {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 10,
            "stage3_max_live_parameters": 0,
            "overlap_comm": True,
            "ignore_unused_parameters": False,
        },
        "data_types": {"grad_accum_dtype": "bf16"},
    }
    assert unused_keys(raw) == [
        "zero_optimization.overlap_comm",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.ignore_unused_parameters",
        "data_types.grad_accum_dtype",
    ]
    # "auto" is an integration's placeholder, fp32 accumulation is FSDP2's own: nothing the fsdp2 backend drops
    quiet = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    assert unused_keys(quiet) == []
