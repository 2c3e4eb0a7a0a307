"""Train, checkpoint, and resume from a DeepSpeed universal checkpoint (`checkpoint.load_universal`).

Modelled on DeepSpeed's `tests/unit/checkpoint/test_universal_checkpoint.py` (commit of DeepSpeed 0.19.8): a model
trained with ZeRO, saved, converted by `deepspeed.checkpoint.ds_to_universal`, and loaded with
`"checkpoint": {"load_universal": true}`. Phases (`--phase`):
- `train`: `--steps` steps, `save_checkpoint(--ckpt, client_state=)`, then `--steps` more; prints every loss (the
  uninterrupted run).
- `resume`: `load_checkpoint(--ckpt, tag=--tag)` with `load_universal`, then `--steps` steps; prints those losses,
  the engine's step count and learning rate after loading, and the client state it returned.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard. `torch_adam: true` so that
DeepSpeed does not JIT-build FusedAdam.
"""

import argparse
import importlib
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))

VOCAB, DIM, SEQ, MICRO = 32, 16, 8, 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: DeepSpeed saves both names (shared_params)
        self.frozen = nn.Linear(DIM, DIM)  # not trained: its weights come from the module state
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.full((DIM,), 0.5))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x)))) + self.frozen(x) * self.scale.to(x.dtype)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), targets.view(-1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}},
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {"stage": args.stage},
        "checkpoint": {"load_universal": args.phase == "resume"},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--phase", choices=["train", "resume"], required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyLM()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config(args))
    rank = engine.global_rank
    losses, loaded = [], {}
    first = 0
    if args.phase == "resume":
        _, client_state = engine.load_checkpoint(args.ckpt, tag=args.tag)
        first = engine.global_steps
        loaded = {"global_steps": engine.global_steps, "lr": engine.get_lr()[0], "epoch": client_state["epoch"]}
    for step in range(first, first + (2 if args.phase == "train" else 1) * args.steps):
        if args.phase == "train" and step == args.steps:
            engine.save_checkpoint(args.ckpt, client_state={"epoch": 7})
            loaded = {"global_steps": engine.global_steps, "lr": engine.get_lr()[0]}  # what a resume must restore
        x, y = batch(step, rank)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / engine.world_size)
    if rank == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": losses, "loaded": loaded}), flush=True)


if __name__ == "__main__":
    main()
