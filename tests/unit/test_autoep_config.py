"""The `expert_parallel` block ([Note: AutoEP]): what is read, what is refused in one line, before any work."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from helpers.hf_moe import tiny_moe
from zeroshard.config import parse_config
from zeroshard.errors import ConfigError
from zeroshard.moe import MoE
from zeroshard.moe.auto import Surroundings, apply_autoep, autoep_of, find_experts, refuse_combinations
from zeroshard.moe.zero import refuse_expert_stage3


def test_absent_or_disabled_block_is_nothing() -> None:
    assert autoep_of(None) is None
    assert autoep_of({"enabled": False, "autoep_size": 4}) is None
    assert autoep_of({"enabled": True, "autoep_size": 4}).size == 4  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("block", "words"),
    [
        ({"enabled": True, "autoep_size": 0}, "autoep_size=0"),
        ({"enabled": "yes"}, "enabled='yes'"),
        ({"enabled": True, "autoep_sise": 2}, "expert_parallel.autoep_sise: unknown key; did you mean autoep_size?"),
        ({"enabled": True, "zzz": 2}, "expert_parallel: unknown keys ['zzz']"),
        ({"enabeld": True}, "expert_parallel.enabeld: unknown key; did you mean enabled?"),  # not left off
        ({"enabled": True, "expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size must be 1"),
        ({"enabled": False, "load_balance_coeff": 0.01}, "load_balance_coeff"),
        ({"enabled": True, "preset_model": "llama"}, "preset_model='llama'"),
        ({"enabled": True, "top_k": 0}, "top_k=0"),
        ({"enabled": True, "expert_pattern": "mlp.experts"}, "without dots"),
    ],
)
def test_refused_in_one_line(block: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        autoep_of(block)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_routing_keys_at_their_defaults_are_accepted() -> None:
    block = {"enabled": True, "autoep_size": 2, "score_func": "auto", "route_scale": 1.0, "route_norm": None}
    assert autoep_of(block) is not None


def test_kernel_choices_warn_naming_them(caplog: pytest.LogCaptureFixture) -> None:
    logging.getLogger("zeroshard").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="zeroshard"):
            autoep_of({"enabled": True, "use_grouped_mm": False, "comm_backend": "deepep", "comm_num_sm": 12})
    finally:
        logging.getLogger("zeroshard").propagate = False
    text = caplog.text
    assert "comm_backend, use_grouped_mm" in text and "comm_num_sm" not in text  # 12 is the default


@pytest.mark.parametrize(
    ("around", "words"),
    [
        (Surroundings(2, "fsdp2", "none", 2), 'backend "fsdp2"'),
        (Surroundings(2, "zero", "nvme", 2), 'offload_optimizer "nvme"'),
        (Surroundings(2, "zero", "none", 4, tp=2), "tp x ep"),
        (Surroundings(1, "zero", "none", 2, sp=2), "sequence parallelism"),
        (Surroundings(2, "zero", "none", 1), "must divide the number of ranks (1)"),
        (Surroundings(2, "zero", "none", 2, has_optimizer=False), "without an optimizer"),
        (Surroundings(2, "zero", "none", 2, node_local=True), "use_node_local_storage"),
        (Surroundings(2, "zero", "none", 2, autocast=True), "torch_autocast"),
    ],
)
def test_combinations_refused(around: Surroundings, words: str) -> None:
    autoep = autoep_of({"enabled": True, "autoep_size": 2})
    assert autoep is not None
    with pytest.raises(ConfigError) as info:
        refuse_combinations(autoep, around, nn.Linear(2, 2))
    assert words in str(info.value)
    one = autoep_of({"enabled": True, "autoep_size": 1})
    assert one is not None
    refuse_combinations(one, around, nn.Linear(2, 2))  # nothing is split: nothing refused


def test_experts_found_in_each_family_and_patterns_narrow_them() -> None:
    every = autoep_of({"enabled": True, "autoep_size": 2})
    assert every is not None
    for kind, blocks in (("mixtral", 2), ("qwen3_moe", 2), ("gpt_oss", 2), ("deepseek_v3", 1)):  # v3: dense first
        assert len(find_experts(tiny_moe(kind), every)) == blocks, kind
    one = autoep_of({"enabled": True, "autoep_size": 2, "moe_layer_pattern": r"model\.layers\.1\.mlp"})
    assert one is not None
    assert [name for name, *_ in find_experts(tiny_moe("mixtral"), one)] == ["model.layers.1.mlp"]


@pytest.mark.parametrize(
    ("kind", "block", "words"),
    [
        ("mixtral", {"autoep_size": 3}, "must divide the 4 experts of model.layers.0.mlp.experts"),
        ("deepseek_v3", {"score_func": "softmax"}, "but model.layers.1.mlp routes with 'sigmoid'"),
        ("mixtral", {"route_scale": 2.5}, "route_scale=2.5, but model.layers.0.mlp routes with 1.0"),
        ("mixtral", {"has_shared_experts": True}, "has_shared_experts=True, but"),
        ("mixtral", {"autoep_size": 8}, "must divide"),
        ("mixtral", {"preset_model": "qwen3_moe"}, "is for model types ['qwen3_moe', 'qwen2_moe']"),
        ("mixtral", {"top_k": 3}, "routes each token to 2 experts"),
        ("mixtral", {"top_k_attr": "num_local_experts"}, "top_k_attr='num_local_experts' (top-k 4)"),
        ("mixtral", {"router_pattern": "router"}, "router_pattern='router': block 'model.layers.0.mlp'"),
        ("gpt_oss", {"router_pattern": "router", "expert_w1": "w1"}, "expert_w1='w1'"),
        ("mixtral", {"moe_layer_pattern": r"model\.layers\.\d+\.self_attn"}, "matching moe_layer_pattern"),
        ("mixtral", {"num_experts_attr": "n_routed_experts"}, "no such attribute"),
    ],
)
def test_model_checks_before_any_split(kind: str, block: dict, words: str) -> None:
    autoep = autoep_of({"enabled": True, "autoep_size": 2, **block})
    assert autoep is not None
    model = tiny_moe(kind)
    with pytest.raises(ConfigError) as info:
        apply_autoep(model, autoep, data_first=False)  # refused before the groups: no process group needed
    assert words in str(info.value), str(info.value)


def test_a_model_without_experts_is_refused() -> None:
    autoep = autoep_of({"enabled": True, "autoep_size": 2})
    assert autoep is not None
    with pytest.raises(ConfigError, match="no MoE block with an experts child 'experts' in Sequential"):
        find_experts(nn.Sequential(nn.Linear(2, 2)), autoep)


def test_routing_keys_that_match_the_model_and_dense_layers_a_pattern_matches() -> None:
    """DeepSpeed's DeepSeek-V3 preset values, written out: they are the model's own routing, so accepted; the
    pattern also matches the dense first layer, which is skipped (as DeepSpeed skips it)."""
    block = {
        "enabled": True, "autoep_size": 2, "moe_layer_pattern": r"model\.layers\.\d+\.mlp", "score_func": "sigmoid",
        "route_norm": True, "routed_scaling_factor": 2.5, "has_shared_experts": True, "num_expert_groups": 1,
        "num_limited_groups": 1, "expert_activation": "swiglu", "score_apply": "post", "top_k": 2,
    }  # fmt: skip
    autoep = autoep_of(block)
    assert autoep is not None
    model = tiny_moe("deepseek_v3")
    found = find_experts(model, autoep)
    assert [name for name, *_ in found] == ["model.layers.1.mlp"]
    from zeroshard.moe.auto import _check_model

    _check_model(model, autoep, found)


@pytest.mark.parametrize(
    ("zero", "words"),
    [
        ({"zero_quantized_weights": True, "zero_hpz_partition_size": 2}, "ZeRO++ (zero_quantized_weights, zero_hpz"),
        ({"zero_quantized_nontrainable_weights": True}, "ZeRO++ (zero_quantized_nontrainable_weights)"),
        ({"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, 'offload to "nvme"'),
        ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, "super_offload"),
    ],
)
def test_stage_3_refusals(zero: dict[str, Any], words: str) -> None:
    """What the experts' units at stage 3 do not combine with ([Note: experts at stage 3]), in one line."""
    cfg = parse_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, **zero}})
    with pytest.raises(ConfigError) as info:
        refuse_expert_stage3(cfg.zero_optimization, nn.Linear(2, 2))
    assert words in str(info.value)
    plain = parse_config({"train_batch_size": 2}).zero_optimization
    refuse_expert_stage3(plain, nn.Linear(2, 2))
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
        layer = MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=1)
    refuse_expert_stage3(plain, meta)  # only MoE layers' experts would start alike on every rank
    with pytest.raises(ConfigError, match="meta device"):
        refuse_expert_stage3(plain, layer)


def test_a_model_built_from_a_config_under_zero_init_is_refused() -> None:
    """[Note: AutoEP under zero_init]: the experts are split as they are read from a checkpoint; a meta model built
    from a config has none to read."""
    import zeroshard

    with zeroshard.zero_init():
        model = tiny_moe("mixtral")
    autoep = autoep_of({"enabled": True, "autoep_size": 2})
    assert autoep is not None
    with pytest.raises(ConfigError, match="from a config"):
        refuse_combinations(autoep, Surroundings(3, "zero", "none", 2), model)
