"""Tensor parallelism's refusals and pure pieces, without a process group: the tensor_parallel block, the mesh
arithmetic, the Hugging Face plan's checks, the combinations refused before any work
(checkpoints across tp sizes: test_tensor_parallel_reslice.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard

from zeroshard.config import parse_config
from zeroshard.errors import ConfigError
from zeroshard.tp.build import autotp_size, loss_parallel_of, refuse_unsupported
from zeroshard.tp.mesh import TensorParallelGrid
from zeroshard.tp.plan import check_divisible, hf_plan
from zeroshard.tp.zero import is_tp_sharded


def _llama(**overrides: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    sizes.update(num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    sizes.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**sizes))


def test_block_keys_and_size() -> None:
    assert autotp_size(None) == 1 and autotp_size({"autotp_size": 0}) == 1 and autotp_size({"autotp_size": 4}) == 4
    with pytest.raises(ConfigError, match=r"tensor_parallel.tp_size: unknown key; did you mean autotp_size\?"):
        autotp_size({"autotp_size": 2, "tp_size": 2})
    with pytest.raises(ConfigError, match=r"tensor_parallel: keys \['injection_policy'\] are not supported"):
        autotp_size({"autotp_size": 2, "injection_policy": {}})
    with pytest.raises(ConfigError, match="tp_overlap_comm=true"):
        autotp_size({"autotp_size": 2, "tp_overlap_comm": True})
    with pytest.raises(ConfigError, match="autotp_size='2'"):
        autotp_size({"autotp_size": "2"})
    assert loss_parallel_of({"autotp_size": 2, "loss_parallel": True}) and not loss_parallel_of(None)
    with pytest.raises(ConfigError, match="tensor_parallel.loss_parallel=1"):
        loss_parallel_of({"loss_parallel": 1})


def test_grid_lays_tp_ranks_consecutively() -> None:
    grid = TensorParallelGrid(tp=2, world_size=8)
    assert grid.dp == 4 and grid.tp_ranks(1) == [2, 3] and grid.dp_ranks(1) == [1, 3, 5, 7]
    assert (grid.dp_index(5), grid.tp_index(5)) == (2, 1)
    with pytest.raises(ConfigError, match="autotp_size=3 must divide the world size 8"):
        TensorParallelGrid(tp=3, world_size=8)


@pytest.mark.parametrize(
    ("overrides", "tp", "match"),
    [
        ({"num_key_value_heads": 1}, 2, "num_key_value_heads=1"),
        ({"vocab_size": 63}, 2, "vocab_size=63"),
        ({"num_attention_heads": 8, "num_key_value_heads": 8}, 3, "num_attention_heads=8"),
        ({"tie_word_embeddings": True}, 2, "tie_word_embeddings=True"),
    ],
)
def test_plan_refuses_what_it_cannot_split(overrides: dict[str, Any], tp: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        hf_plan(_llama(**overrides), tp)


def test_plan_maps_the_config_and_the_vocabulary() -> None:
    plan = hf_plan(_llama(), 2)
    assert type(plan["model.layers.*.self_attn.q_proj"]).__name__ == "ColwiseParallel"
    assert type(plan["model.layers.*.mlp.down_proj"]).__name__ == "RowwiseParallel"
    assert {"model.embed_tokens", "lm_head"} <= set(plan)
    assert hf_plan(_llama(), 2, vocab_parallel_loss=True)["lm_head"].output_layouts == (Shard(-1),)
    with pytest.raises(ConfigError, match="not a Hugging Face model whose config has base_model_tp_plan"):
        hf_plan(torch.nn.Linear(2, 2), 2)
    check_divisible(object(), 2)  # no sizes: nothing to check


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"zero_optimization": {"stage": 3}}, 'autotp_size=2 with zero_optimization.stage 3 on the "zero" backend'),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
    ],
)
def test_refused_combinations(extra: dict[str, Any], match: str) -> None:
    cfg = parse_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}, **extra})
    with pytest.raises(ConfigError, match=match):
        refuse_unsupported(cfg, torch.nn.Linear(2, 2), 2, None)


def test_meta_model_refused() -> None:
    cfg = parse_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}})
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="meta device"):
        refuse_unsupported(cfg, model, 2, None)


def test_mpu_with_fsdp2_refused() -> None:
    cfg = parse_config({"train_micro_batch_size_per_gpu": 1, "zeroshard": {"backend": "fsdp2"}})
    with pytest.raises(ConfigError, match='mpu=...\\) with zeroshard.backend "fsdp2"'):
        refuse_unsupported(cfg, torch.nn.Linear(2, 2), 2, object())
    fsdp2 = parse_config({"train_micro_batch_size_per_gpu": 1, "zeroshard": {"backend": "fsdp2"}, **_STAGE3})
    refuse_unsupported(fsdp2, torch.nn.Linear(2, 2), 2, None)  # ZeRO-3 with tp: FSDP2 over dp


_STAGE3 = {"zero_optimization": {"stage": 3}}


def test_megatron_marked_parameters_count_as_sharded() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    assert not is_tp_sharded(param)
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    assert is_tp_sharded(param)
