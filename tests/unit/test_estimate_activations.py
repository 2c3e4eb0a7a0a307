"""`zeroshard estimate --model DIR`'s activation bytes against a measurement, for three small Llama shapes, with
and without activation checkpointing. Measured as [Note: measuring activation memory] in helpers/activations.py
says: the peak of bytes allocated during one forward and backward and alive at once, parameter gradients left out
(model states), every op's output tracked with its lifetime on CPU. Acceptance: within 15%."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.activations import peak_activation_bytes
from zeroshard.cli.main import main

SHAPES = {
    "gqa": dict(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "wide": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
    ),
    "deep": dict(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=128,
    ),
}
SEQ, MICRO = 128, 2


def _estimate(
    folder: str,
    dtype: str,
    checkpointing: bool,
    capsys: pytest.CaptureFixture[str],
    attention: str | None = None,
    seq: int = SEQ,
) -> int:
    argv = ["estimate", *(["--attn-implementation", attention] if attention else []), "--model", folder, "--json"]
    argv += ["--gpus", "1", "--seq-len", str(seq), "--micro-batch", str(MICRO)]
    argv += ["--dtype", dtype] + (["--gradient-checkpointing"] if checkpointing else [])
    assert main(argv) == 0
    return int(json.loads(capsys.readouterr().out)[0]["activation_bytes_per_rank"])


def _measure(config: object, dtype: torch.dtype, checkpointing: bool, seq: int = SEQ) -> int:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, config.vocab_size, (MICRO, seq))  # type: ignore[attr-defined]
    with peak_activation_bytes(model) as measured:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return measured.peak


@pytest.mark.parametrize(("name", "dtype"), [("gqa", "fp32"), ("wide", "fp32"), ("deep", "fp32"), ("deep", "bf16")])
def test_estimated_activations_are_within_15_percent_of_the_measured_peak(name, dtype, tmp_path, capsys):
    from transformers import LlamaConfig

    config = LlamaConfig(max_position_embeddings=SEQ, **SHAPES[name])
    config.save_pretrained(tmp_path)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    for checkpointing in (False, True):
        estimated = _estimate(str(tmp_path), dtype, checkpointing, capsys)
        measured = _measure(config, torch_dtype, checkpointing)
        assert abs(estimated - measured) <= 0.15 * measured, (name, dtype, checkpointing, estimated, measured)


MOE = {  # transformers 5's sparse MoE layers ([Note: activation estimate of experts])
    "qwen3_moe": ("Qwen3MoeConfig", dict(SHAPES["gqa"], num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64)),
    "qwen3_moe-k4": ("Qwen3MoeConfig", dict(SHAPES["deep"], num_experts=16, num_experts_per_tok=4,
                     moe_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(SHAPES["wide"], num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe-shared": ("Qwen2MoeConfig", dict(SHAPES["gqa"], num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=64, shared_expert_intermediate_size=128)),
    "qwen2_moe-dense-last": ("Qwen2MoeConfig", dict(SHAPES["gqa"], num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=64, mlp_only_layers=[3])),
}  # fmt: skip


MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24)
LATENT = {  # DeepSeek's multi-head latent attention ([Note: activation estimate of MLA]); v_head_dim = nope + rope
    # keeps the CPU on its fused attention kernel, as a GPU's kernels are with any v_head_dim
    "deepseek_v3-dense": ("DeepseekV3Config", dict(SHAPES["gqa"], **MLA, q_lora_rank=48, first_k_dense_replace=4,
                          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "deepseek_v3-moe": ("DeepseekV3Config", dict(SHAPES["gqa"], **MLA, q_lora_rank=48, first_k_dense_replace=1,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        n_group=1, topk_group=1)),
    "deepseek_v2-lite": ("DeepseekV2Config", dict(SHAPES["gqa"], **MLA, q_lora_rank=None, first_k_dense_replace=1,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MOE) + sorted(LATENT))
def test_estimated_activations_of_moe_models_are_within_15_percent(name, tmp_path, capsys):
    import transformers

    kind, sizes = {**MOE, **LATENT}[name]
    config = getattr(transformers, kind)(max_position_embeddings=SEQ, **sizes)
    config.save_pretrained(tmp_path)
    for checkpointing in (False, True):
        estimated = _estimate(str(tmp_path), "fp32", checkpointing, capsys)
        measured = _measure(config, torch.float32, checkpointing)
        assert abs(estimated - measured) <= 0.15 * measured, (name, checkpointing, estimated, measured)


TINY = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            vocab_size=128)  # fmt: skip
EAGER = {  # attention run eagerly ([Note: activation estimate of eager attention]): seq x seq scores per layer
    # Llama asked for eager (`--attn-implementation eager`), fp32 and bf16; at 512 tokens the scores dominate
    "llama-eager": ("LlamaConfig", dict(SHAPES["gqa"]), "fp32", "eager", SEQ),
    "llama-eager-bf16": ("LlamaConfig", dict(SHAPES["gqa"]), "bf16", "eager", SEQ),
    "llama-eager-512": ("LlamaConfig", TINY, "fp32", "eager", 512),
    # eager by default: Gemma-2 (score and logit softcapping, four norms per layer, sliding-window layers), GPT-OSS
    # (sinks, clamped GLU experts, its softmax in the compute dtype)
    "gemma2": ("Gemma2Config", dict(SHAPES["gqa"], head_dim=16), "fp32", None, SEQ),
    "gemma2-512-bf16": ("Gemma2Config", dict(TINY, head_dim=8, sliding_window=64), "bf16", None, 512),
    "gpt_oss": ("GptOssConfig", dict(SHAPES["gqa"], head_dim=16, num_local_experts=4, num_experts_per_tok=2),
                "fp32", None, SEQ),
    "gpt_oss-512-bf16": ("GptOssConfig", dict(TINY, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
                         "bf16", None, 512),
    # SDPA with four norms per layer
    "gemma3": ("Gemma3TextConfig", dict(SHAPES["gqa"], head_dim=16), "fp32", None, SEQ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EAGER))
def test_estimated_activations_of_eager_attention_are_within_15_percent(name, tmp_path, capsys):
    import transformers

    kind, sizes, dtype, attention, seq = EAGER[name]
    extra = {"rope_scaling": None} if kind == "GptOssConfig" else {}
    config = getattr(transformers, kind)(max_position_embeddings=seq, **sizes, **extra)
    config.save_pretrained(tmp_path)
    if attention is not None:  # as training asks for it: from_pretrained(..., attn_implementation="eager")
        config._attn_implementation = attention
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    for checkpointing in (False, True):
        estimated = _estimate(str(tmp_path), dtype, checkpointing, capsys, attention, seq)
        measured = _measure(config, torch_dtype, checkpointing, seq)
        assert abs(estimated - measured) <= 0.15 * measured, (name, checkpointing, estimated, measured)
