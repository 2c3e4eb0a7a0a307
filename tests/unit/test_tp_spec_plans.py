"""DeepSpeed's AutoTP layer specs read into a plan without a process group ([Note: autotp layer specs]): which module
gets which style, the preset merged after custom specs, and one line for each spec or model it cannot split."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from helpers.tp_parity import SPECS, llama
from zeroshard.config import parse_config
from zeroshard.config.resolve import resolve_config
from zeroshard.errors import ConfigError
from zeroshard.tp.plan import ReplicatedOverHeads, model_plan
from zeroshard.tp.specs import partition_config_of


def _plan(block: dict[str, Any], model: nn.Module | None = None, tp: int = 2, **kw: Any) -> dict[str, Any]:
    return model_plan(model if model is not None else llama(), tp, {"autotp_size": tp, **block}, **kw)


def _spec(patterns: list[str], kind: str = "column", **extra: Any) -> dict[str, Any]:
    return {"partition_config": {"layer_specs": [{"patterns": patterns, "partition_type": kind, **extra}]}}


def test_custom_specs_split_what_they_match_first_match_wins() -> None:
    plan = _plan(SPECS["custom"])
    assert isinstance(plan["model.layers.0.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.1.self_attn.o_proj"], RowwiseParallel)
    assert "model.layers.1.mlp.down_proj" not in plan and "model.embed_tokens" not in plan  # unmatched: whole
    head = plan["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)  # gathered logits


def test_preset_and_custom_specs_merge_custom_first() -> None:
    block = {"preset_model": "llama", **_spec([r".*\.o_proj\.weight$"], "skip")}
    plan = _plan(block)
    assert "model.layers.0.self_attn.o_proj" not in plan  # the custom skip comes first
    assert isinstance(plan["model.layers.0.mlp.down_proj"], RowwiseParallel)  # the preset's
    block["partition_config"]["use_default_specs"] = False
    with pytest.raises(ConfigError, match="nothing would be split"):  # only the custom skip
        _plan(block)
    assert "lm_head" not in _plan({"preset_model": "LLaMA"})  # DeepSpeed's presets leave the head whole


def test_model_types_head_row_and_grad_allreduce_specs() -> None:
    with pytest.raises(ConfigError, match="no layer of this llama model matches a column or row spec"):
        _plan(_spec([r".*_proj\.weight$"], model_types=["qwen2"]))
    with pytest.raises(ConfigError, match="preset_model: no layer of this llama model"):
        _plan({"preset_model": "bloom"})  # another family's module names
    assert len(_plan(_spec([r".*_proj\.weight$"], model_types=[]))) == 14  # [] restricts nothing, as in DeepSpeed
    assert "model.embed_tokens" in _plan({"partition_config": {}})  # empty: none, the Hugging Face plan
    assert len(_plan(_spec([r".*_proj\.weight$"], model_types=["LLAMA"]))) == 14
    row_head = _plan(_spec([r"lm_head\.weight$"], "row"))["lm_head"]
    assert isinstance(row_head, RowwiseParallel) and row_head.input_layouts == (Replicate(),)
    vocab = _plan(_spec([r"lm_head\.weight$"]), vocab_parallel_loss=True)["lm_head"]
    assert vocab.output_layouts == (Shard(-1),) and not vocab.use_local_output
    norms = _spec([r".*_norm\.weight$"], "skip", grad_allreduce=True)
    with pytest.raises(ConfigError, match="nothing would be split"):
        _plan(norms, llama(arch="qwen3"))
    norms["partition_config"]["layer_specs"].append({"patterns": [r".*\.q_proj\.weight$"]})
    qwen = {k: v for k, v in _plan(norms, llama(arch="qwen3")).items() if "_norm" in k}
    assert all(isinstance(s, ReplicatedOverHeads) for s in qwen.values())
    assert sorted(qwen)[:2] == ["model.layers.0.self_attn.k_norm", "model.layers.0.self_attn.q_norm"]


def test_hf_plan_styles_of_qwen3_and_phi3() -> None:
    qwen = _plan({}, llama(arch="qwen3"))
    assert isinstance(qwen["model.layers.*.self_attn.k_norm"], ReplicatedOverHeads)
    phi = _plan({}, llama(arch="phi3"))
    qkv, o_proj = phi["model.layers.*.self_attn.qkv_proj"], phi["model.layers.*.self_attn.o_proj"]
    assert qkv.output_layouts == (Replicate(),) and o_proj.input_layouts == (Replicate(),)


@pytest.mark.parametrize(
    ("block", "words"),
    [
        ({"partition_config": {"layer_spec": []}}, "layer_specs"),
        ({"partition_config": {"embedding_partition_dim": 0}}, "embedding_partition_dim"),
        ({"partition_config": {"tp_size": 4}}, "tp_size=4"),
        ({"partition_config": {"strict_mode": "yes"}}, "strict_mode='yes'"),
        ({"preset_model": "gpt2"}, "preset_model='gpt2'"),
        (_spec(["("]), "not a regular expression"),
        (_spec([]), "patterns"),
        (_spec(["x"], "diagonal"), "partition_type='diagonal'"),
        (_spec(["x"], "row", shape=[-1, 2], partition_dim=1), "shape=[-1, 2]"),
        (_spec(["x"], shape=[[64, 32, 32], -1]), "parts of unequal sizes"),
        (_spec(["x"], shape=[[True, True], -1]), "parts of unequal sizes"),
        (_spec(["x"], shape=[4, -1, 8], partition_dim=1), "3-D views"),
        (_spec(["x"], partition_dim=1), "partition_dim=1"),
        (_spec(["x"], "row", gather_output=True), "gather_output"),
        (_spec(["x"], patern="y"), "did you mean patterns"),
    ],
)
def test_bad_specs_are_refused_in_one_line(block: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        partition_config_of(block, 2)
    assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError):  # the same at config resolution (zeroshard validate-config)
        resolve_config(
            parse_config({"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2, **block}}), world_size=4
        )


@pytest.mark.parametrize(
    ("block", "words"),
    [
        (_spec([r".*embed_tokens\.weight$"]), "is a Embedding"),
        (_spec([r".*q_proj\.weight$"]), "do not divide by autotp_size=3"),
        (_spec([r"lm_head\.weight$"]), "set gather_output true"),
        ({"partition_config": {"strict_mode": True, **_spec([r".*q_proj\.weight$"])["partition_config"]}}, "strict"),
        (_spec([r".*q_proj\.weight$"]) | {"loss_parallel": True}, "vocab_parallel_lm_head) true needs the output head"),
        (_spec([r"lm_head\.weight$"], gather_output=True) | {"loss_parallel": True}, "with its logits left sharded"),
    ],
)
def test_models_the_specs_cannot_split_are_refused(block: dict[str, Any], words: str) -> None:
    tp = 3 if "divide" in words else 2
    vocab = bool(block.pop("loss_parallel", False))
    with pytest.raises(ConfigError) as err:
        _plan(block, tp=tp, vocab_parallel_loss=vocab)
    assert words in str(err.value), err.value


def test_fused_parts_and_the_presets_with_them() -> None:
    from zeroshard.tp.plan import BlockColwiseParallel

    phi = llama(arch="phi3")  # DeepSpeed's phi3 preset leaves qkv_proj split: transformers' attention cannot read it
    with pytest.raises(ConfigError, match="Phi-3 attention reads q, k and v at the config's full sizes"):
        _plan({"preset_model": "phi3"}, phi)
    odd = _spec([r".*qkv_proj\.weight$"], shape=[3, -1], gather_output=True)  # q 64 + k 32 + v 32 rows
    with pytest.raises(ConfigError, match=r"\(128\) do not divide into 3 parts each divisible by autotp_size=2"):
        _plan(odd, phi)
    with pytest.raises(ConfigError, match="parts add up to 32 rows, the weight has 256"):
        _plan(_spec([r".*gate_up_proj\.weight$"], shape=[[16, 16], -1]), phi)
    gate_up = _plan(_spec([r".*gate_up_proj\.weight$"], shape=[2, -1]), phi)["model.layers.0.mlp.gate_up_proj"]
    assert isinstance(gate_up, BlockColwiseParallel) and gate_up.blocks == 2 and not gate_up.gather
    equal = _plan(_spec([r".*qkv_proj\.weight$"], shape=[[32, 32, 32, 32], -1], gather_output=True), phi)
    assert all(s.blocks == 4 and s.gather for s in equal.values()) and len(equal) == 2


def test_a_tied_weight_is_not_split_by_a_spec() -> None:
    model = llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="shared with another module"):
        _plan(_spec([r"lm_head\.weight$"], gather_output=True), model)
