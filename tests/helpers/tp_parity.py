"""A tiny Llama-shaped Hugging Face model, its single-process reference and the tensor-parallel engine runner.

The reference runs each data-parallel replica's micro-batch through one whole model and averages the replicas'
losses (the engine's gradient mean over dp); torch's AdamW and clip_grad_norm_ step it. Both sides build the model
from the same seed; the engine splits it over the tp ranks ([Note: autotp plan]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

VOCAB, SEQ, B = 128, 16, 2  # vocabulary, tokens per sequence, sequences per replica
LR, CLIP = 1e-2, 0.5  # the clip is below the first steps' norms (~1-3): clipping is active


@dataclass(frozen=True)
class TpCase:
    stage: int = 1
    steps: int = 3
    gas: int = 1
    clip: float = CLIP
    loss_parallel: bool = False  # [Note: vocab-parallel loss]: the loss a DTensor, logits vocab-sharded
    backend: str = "zero"  # "fsdp2": [Note: tensor parallelism on fsdp2]
    client_optimizer: bool = False  # torch's AdamW passed to initialize instead of the config's
    left_out: bool = False  # LEFT_OUT not optimized: fp32 stage 0 still clips over them ([Note: clipping over ...])
    arch: str = "llama"  # ARCHS: the model; "qwen3" and "phi3" use more of transformers' tp_plan styles
    specs: str = ""  # a key of SPECS: tensor_parallel keys beside autotp_size (partition_config, preset_model)

    @property
    def name(self) -> str:
        lp, client, out = int(self.loss_parallel), int(self.client_optimizer), int(self.left_out)
        head = f"{self.arch}-{self.specs}-" if self.arch != "llama" or self.specs else ""
        return f"{head}{self.backend}-s{self.stage}-gas{self.gas}-clip{self.clip:g}-lp{lp}-client{client}-out{out}"


# replicated; row-parallel (Shard(1)); Qwen3's q_norm, whose gradient is Partial until summed over tp
LEFT_OUT = ("model.norm.weight", "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_norm.weight")


def optimized(model: torch.nn.Module, case: TpCase) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if not (case.left_out and n in LEFT_OUT)]


def llama(seed: int = 0, arch: str = "llama") -> torch.nn.Module:
    """A tiny decoder of `arch`: Llama (colwise/rowwise), Qwen3 (q_norm/k_norm "replicated_with_grad_allreduce"),
    Phi-3 (fused qkv_proj and gate_up_proj, "colwise_gather_output" / "rowwise_split_input")."""
    import transformers

    config_class, model_class = ARCHS[arch]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **({"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2} if arch == "phi3" else {}),  # (32000 > VOCAB)
    )
    model = getattr(transformers, model_class)(cfg)
    if arch == "qwen3":  # RMSNorm weights start at one: make q_norm/k_norm differ per element so a wrong sum shows
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.add_(0.1 * torch.randn_like(param))
    return model


TRAINED = ("layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight", "layers.1.mlp.down_proj.weight")

QUERY = {  # the first query projection's weight (fused in Phi-3 and GPT-NeoX)
    "phi3": "model.layers.0.self_attn.qkv_proj.weight",
    "gpt_neox": "gpt_neox.layers.0.attention.query_key_value.weight",
}

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),  # embed_in "embedding_rowwise"; fused per-head qkv colwise
}

# Llama's tp plan written as DeepSpeed's partition_config, the MLP of layer 1 left whole (unmatched) and the untied
# lm_head split with its logits gathered; and DeepSpeed's "llama" preset (the same split of every layer, lm_head whole)
_ROW = {
    "patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.layers\.0\.mlp\.down_proj\.weight$"],
    "partition_type": "row",
}
SPECS: dict[str, dict[str, Any]] = {
    "custom": {
        "partition_config": {
            "use_default_specs": False,
            "layer_specs": [
                _ROW,
                {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"},
                {"patterns": [r".*\.layers\.0\.mlp\.(gate|up)_proj\.weight$"], "partition_type": "column"},
                {"patterns": [r"lm_head\.weight$"], "partition_type": "column", "gather_output": True},
            ],
        }
    },
    "preset": {"preset_model": "llama"},
    # Phi-3's fused layers by sub-parameter specs ([Note: fused sub-parameters]): qkv_proj (q 64, k 32, v 32 rows) in
    # 4 parts, gathered (its attention slices q/k/v by the config's sizes: any parts gather back); gate_up_proj in 2
    # parts, each rank's [gate, up] slices chunked locally into down_proj's input slice; o_proj whole
    "fused": {
        "partition_config": {
            "layer_specs": [
                {"patterns": [r".*\.qkv_proj\.weight$"], "shape": [4, -1], "partition_dim": 0, "gather_output": True},
                {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [[128, 128], -1]},
                {"patterns": [r".*\.down_proj\.weight$"], "partition_type": "row"},
            ],
        }
    },
}


def batch(step: int, replica: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + replica)
    return torch.randint(0, VOCAB, (B, SEQ), generator=gen)


def config(case: TpCase, tp: int = 2) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": case.gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": case.clip,
        "zero_optimization": {"stage": case.stage, "reduce_bucket_size": 5000, "allgather_bucket_size": 5000},
        "tensor_parallel": {"autotp_size": tp, "loss_parallel": case.loss_parallel, **SPECS.get(case.specs, {})},
        "zeroshard": {"backend": case.backend},
    }


def reference(case: TpCase, dp: int) -> tuple[list[list[float]], list[float]]:
    """Per step, every replica's loss; and each step's gradient norm before clipping."""
    losses, norms, _ = trained_reference(case, dp)
    return losses, norms


def trained_reference(case: TpCase, dp: int) -> tuple[list[list[float]], list[float], torch.nn.Module]:
    """`reference`'s losses and norms, and the model after its steps."""
    model = llama(arch=case.arch)
    opt = torch.optim.AdamW(optimized(model, case), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(case.steps):
        micro = range(step * case.gas, (step + 1) * case.gas)
        per = [model(input_ids=ids, labels=ids).loss for m in micro for ids in (batch(m, r) for r in range(dp))]
        model.zero_grad()  # the left-out parameters' too, as the engine's step clears every module gradient
        torch.stack(per).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip if case.clip > 0 else float("inf"))
        opt.step()
        losses.append([float(v.detach()) for v in per])
        norms.append(float(norm))
    return losses, norms, model


def run(engine: Any, replica: int, steps: range, gas: int = 1) -> tuple[list[float], list[float]]:
    """This replica's loss per micro-step, and the engine's gradient norm per optimizer step."""
    losses, norms = [], []
    for step in steps:
        for m in range(step * gas, (step + 1) * gas):
            ids = batch(m, replica)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def engine_losses(rank: int, case: TpCase, tp: int = 2) -> dict[str, Any]:
    import zeroshard

    model = llama(arch=case.arch)
    cfg = config(case, tp)
    if case.client_optimizer:
        del cfg["optimizer"]
        optimizer = torch.optim.AdamW(optimized(model, case), lr=LR, weight_decay=0.0)
        engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=cfg)
    else:
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=optimized(model, case), config=cfg)
    replica = rank // tp
    losses, norms = run(engine, replica, range(case.steps), case.gas)
    q = model.get_parameter(QUERY.get(case.arch, "model.layers.0.self_attn.q_proj.weight"))
    out = {"losses": losses, "norms": norms, "q_local": list(q.to_local().shape), "dp": engine.dp_world_size}
    # the tensor-parallel placement (the last: fsdp2 puts its dp placement first)
    out["placements"] = {n: repr(p.placements[-1]) for n, p in model.named_parameters() if hasattr(p, "placements")}
    whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    out["trained"] = {n: p.detach().clone() for n, p in whole.items() if n.endswith(TRAINED)}
    assert engine.strategy.comm.world_size == engine.dp_world_size  # ZeRO shards over the data-parallel group
    try:  # the local slices are not the whole model: refused, not a partial state dict
        engine.consolidated_state_dict()
        out["consolidation"] = "done"
    except Exception as e:  # noqa: BLE001 - compared by the test
        out["consolidation"] = f"{type(e).__name__}: {e}"
    engine.destroy()
    return out


def resume(
    rank: int, case: TpCase, save_dir: str, save_at: int, other_tp: int | None = None, tp: int = 2
) -> dict[str, Any]:
    """Losses and norms of uninterrupted steps (autotp_size `tp`), and losses of a second engine (differently
    seeded) loading the checkpoint saved after `save_at` steps and running the rest; with `other_tp`, the loss of
    this replica's next batch in an engine of that autotp_size loading the checkpoint ([Note: tensor-parallel
    resharding])."""
    import zeroshard

    replica = rank // tp
    model = llama(arch=case.arch)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(case, tp))
    straight, norms = run(engine, replica, range(save_at))
    engine.save_checkpoint(save_dir, tag="mid")
    more = run(engine, replica, range(save_at, case.steps))
    engine.destroy()
    out = {"straight": straight + more[0], "norms": norms + more[1]}
    out["resumed"] = continue_from(rank, case, save_dir, save_at, tp)
    if other_tp is not None:
        other = llama(seed=7, arch=case.arch)
        cfg = config(case, other_tp)
        engine, _, _, _ = zeroshard.initialize(model=other, model_parameters=other.parameters(), config=cfg)
        engine.load_checkpoint(save_dir, tag="mid")
        ids = batch(save_at, replica)
        out["other_tp_loss"] = float(engine(input_ids=ids, labels=ids).loss)
        engine.destroy()
    return out


def continue_from(rank: int, case: TpCase, load_dir: str, save_at: int, tp: int) -> list[float]:
    """This replica's losses of steps `save_at`.. in an engine of autotp_size `tp` (differently seeded) that loaded
    the checkpoint `load_dir`/mid, whatever autotp_size wrote it."""
    import zeroshard

    fresh = llama(seed=7, arch=case.arch)
    engine, _, _, _ = zeroshard.initialize(model=fresh, model_parameters=fresh.parameters(), config=config(case, tp))
    engine.load_checkpoint(load_dir, tag="mid")
    losses = run(engine, rank // tp, range(save_at, case.steps))[0]
    engine.destroy()
    return losses
