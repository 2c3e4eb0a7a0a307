"""Tiny Hugging Face mixture-of-experts models (transformers 5 holds their experts fused) and their checkpoints."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
KINDS = ("qwen3_moe", "mixtral")


def tiny_moe(kind: str, seed: int = 0) -> Any:
    """Two layers of four experts, two per token; the router's auxiliary loss is in the loss."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.01,
        "output_router_logits": True,
    }
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=4))
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4))
    if kind == "deepseek_v3":  # a dense first layer, a shared expert, latent attention
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        mla = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
        del common["router_aux_loss_coef"], common["output_router_logits"]
        common["num_key_value_heads"] = common["num_attention_heads"]  # latent attention has no grouped heads
        config = DeepseekV3Config(
            **common, **mla, n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1,
        )  # fmt: skip
        return DeepseekV3ForCausalLM(config)
    if kind == "gpt_oss":  # biased, interleaved gate/up with a clamped GLU; a biased router; sliding windows
        from transformers import GptOssConfig, GptOssForCausalLM

        del common["max_position_embeddings"]  # (its YaRN factor is set for the default length)
        config = GptOssConfig(
            **common, num_local_experts=4, head_dim=8, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        model = GptOssForCausalLM(config)
        with torch.no_grad():  # transformers starts the expert biases at zero
            for name, param in model.named_parameters():
                if name.endswith("_bias"):
                    param.normal_(0.0, 0.02)
        return model
    raise ValueError(kind)


def save_moe(kind: str, folder: str) -> None:
    """transformers writes each expert apart (Mixtral under its old `block_sparse_moe` name), in several files."""
    tiny_moe(kind).save_pretrained(folder, max_shard_size="20KB")


def token_batches(world_size: int, steps: int = 3, micro: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (world_size * micro, 12), generator=generator) for _ in range(steps)]
