"""DeepSpeed-Chat's step-1 fine-tuning at ZeRO-3: train, count the parameters, save the model, reload it.

Re-created (rewritten, trimmed to one file) from DeepSpeedExamples `applications/DeepSpeed-Chat`, commit
70f35772f9b83253d435cabd7bebaaef815b8db3: `training/step1_supervised_finetuning/main.py`'s loop and evaluation,
`dschat/utils/ds_utils.py`'s `get_train_ds_config` ZeRO block, `dschat/utils/utils.py`'s parameter groups, all-reduced
mean, and the two helpers that read DeepSpeed's ZeRO-3 parameter attributes: the save (gather each parameter that
has `ds_id` and whose `ds_status` is `ZeroParamStatus.NOT_AVAILABLE`, then `p.data.cpu()`) and, from
`dschat/utils/perf.py`, the parameter count (`p.ds_numel if hasattr(p, "ds_tensor") else p.numel()`).
Kept as upstream: those attribute reads, `ZeroParamStatus` imported from `deepspeed.runtime.zero.partition_parameters`,
`deepspeed.zero.GatheredParameters(..., enabled=True)`, the ZeRO-3 keys (overlap_comm, persistence threshold 1e4,
max live parameters and prefetch bucket 3e7), gradient clipping 1.0, an OPT causal LM, AdamW over the weight-decay
groups with betas (0.9, 0.95), a cosine schedule with warm-up, the mean loss over ranks, the evaluation before the
save. Changed: a small OPT built from a config (no hub download), with `stage3_max_live_parameters` scaled down with
it (1e5 for 3e7), so that the evaluation leaves the layers released at the save as it does at DeepSpeed-Chat's sizes
(3e7 holds this whole model: nothing would be gathered by the save and no attribute read); fp32 (the CPU reference:
DeepSpeed refuses fp16 on CPU, bf16 is slow here) and torch's AdamW (DeepSpeed's FusedAdam needs CUDA), random
tokens, four steps. Kept too: `save_hf_format` on rank 0 alone before the ZeRO-3 save, whose file replaces its
(at ZeRO-3 its `model.state_dict()` returns placeholders under DeepSpeed, and under zeroshard it stands down to them
beside the other ranks' gathering: [Note: a state_dict() made alone]). The saved file is reloaded into a fresh
model in one process and evaluated; the report adds the count, the saved weights' sum of |values| and that
evaluation (and, not compared, how many parameters the save gathered: 24 here, none under DeepSpeed, which keeps
the layers gathered after the evaluation). The library is a switch: COMPAT_LIB=deepspeed (default) or
COMPAT_LIB=zeroshard.
"""

import argparse
import importlib
import json
import os

import torch
import torch.distributed as dist
from transformers import OPTConfig, OPTForCausalLM, get_scheduler

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
ZeroParamStatus = importlib.import_module(f"{deepspeed.__name__}.runtime.zero.partition_parameters").ZeroParamStatus

NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


def opt_model() -> OPTForCausalLM:
    torch.manual_seed(1234)
    config = OPTConfig(
        vocab_size=256,
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=128,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return OPTForCausalLM(config)


def train_config(world_size: int) -> dict:
    return {
        "train_batch_size": 4 * world_size,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "none"},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 1e5,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


def grouped_parameters(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decayed = [p for n, p in model.named_parameters() if p.requires_grad and not any(k in n.lower() for k in NO_DECAY)]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and any(k in n.lower() for k in NO_DECAY)]
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def to_fetch(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters DeepSpeed-Chat gathers: partitioned by ZeRO-3 and not gathered now."""
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def saved_state(engine, rank: int) -> tuple[dict[str, torch.Tensor], int]:
    """The save of a ZeRO-3 model: each parameter gathered on its own, copied to the CPU, kept by rank 0; and how many
    the save had to gather."""
    out, fetched = {}, 0
    for name, param in engine.module.named_parameters():
        if hasattr(param, "ds_id"):
            fetch = to_fetch([param])
            fetched += len(fetch)
            with deepspeed.zero.GatheredParameters(fetch, enabled=True):
                value = param.data.cpu()
        else:
            value = param.cpu()
        if rank == 0:
            out[name] = value
    return out, fetched


def save_hf_format(engine, output_dir: str) -> None:
    """DeepSpeed-Chat's `save_hf_format` (rank 0 only): the module's `state_dict()` without LoRA keys; its config."""
    model_to_save = engine.module if hasattr(engine, "module") else engine
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    os.makedirs(output_dir, exist_ok=True)
    torch.save(save_dict, os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 256, (4, 32), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def evaluate(forward, rank: int) -> torch.Tensor:
    with torch.no_grad():
        return forward(**batch(99, rank)).loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = opt_model()
    optimizer = torch.optim.AdamW(grouped_parameters(model, 0.0), lr=1e-3, betas=(0.9, 0.95))
    scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=1, num_training_steps=4)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=train_config(world), dist_init_required=True
    )
    losses = []
    for step in range(4):
        engine.train()
        loss = engine(**batch(step, rank), use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.detach().clone()).item())
    engine.eval()
    eval_loss = mean_over_ranks(evaluate(engine, rank)).item()
    count = parameter_count(engine.module)
    if rank == 0:
        save_hf_format(engine, args.output_dir)
    state, fetched = saved_state(engine, rank)
    if rank == 0:
        path = os.path.join(args.output_dir, "pytorch_model.bin")
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(state, path)
        fresh = opt_model()
        missing, unexpected = fresh.load_state_dict(torch.load(path), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embeddings
        fresh.eval()
        # the reloaded model on each rank's evaluation batch, averaged as the engine's evaluation was
        reloaded = sum(evaluate(fresh, r).item() for r in range(world)) / world
        result = {
            "train": losses,
            "eval": [eval_loss],
            "parameter_count": [float(count)],
            "saved_abs_sum": [float(sum(v.abs().sum().item() for v in state.values()))],
            "reloaded_eval": [reloaded],
        }
        # not compared: DeepSpeed keeps the layers gathered after the evaluation and gathers none here
        print("COMPAT_RESULT " + json.dumps({"losses": result, "gathered_by_the_save": fetched}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
