"""One way of loading a Hugging Face checkpoint, timed and measured in each rank (run by torchrun).

    python -m benchmarks.load_worker make --folder /tmp/llama --layers 16 --hidden 1536
    torchrun --standalone --nproc_per_node 2 -m benchmarks.load_worker load \
        --variant zeroshard --folder /tmp/llama --out /tmp/rows

`make` builds a synthetic Llama from a `LlamaConfig` (or a Qwen3-MoE with `--experts`; seeded random weights) and
saves it as a sharded fp32 safetensors checkpoint. `load` imports everything, reads the rank's own VmHWM, then
times (barrier to barrier, so the slowest rank) the load of one variant:

- `zeroshard`: `with zeroshard.zero_init(): from_pretrained(folder)` then `zeroshard.initialize`, stage 3, no
  optimizer (the load alone).
- `zeroshard-adamw`: the same with `"optimizer": AdamW` in the config (what a training job pays at start).
- `transformers`: a plain `from_pretrained(folder, dtype=float32)` on every rank, no engine (every rank holds
  the whole model, as `zeroshard train` did before the streaming load).
- `deepspeed`: transformers' DeepSpeed integration: an `HfDeepSpeedConfig` with a stage-3 config alive during
  `from_pretrained` (which then builds and loads under `deepspeed.zero.Init`), then `deepspeed.initialize`.

After the timed part each rank reads its VmHWM again (peak resident set as the OS counts it, file-backed pages
of memory-mapped checkpoint files included, with RssAnon and RssFile at that moment), then all ranks run the
fixed batch, timed and measured the same way (transformers' parameters can be views of the mapped files, read
on first touch: the first forward is where such a load finishes), then once more (the steady state, for
comparison). Rank 0 saves the first logits so the driver can compare variants. Each rank writes
`<variant>-rank<r>.json` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VARIANTS = ("zeroshard", "zeroshard-adamw", "transformers", "deepspeed")
SEQ = 32


def status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmHWM: peak resident set; VmRSS: resident set now)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def llama_config(args: argparse.Namespace) -> Any:
    """The Llama of the given sizes; with --experts a Qwen3-MoE of them (each layer's MLP is --experts experts of
    width --expert-intermediate, --experts-per-token chosen per token), whose checkpoint stores the experts apart
    ([Note: converted checkpoints in a streaming load])."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    if args.experts:
        return Qwen3MoeConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate or 8 * args.hidden // 3 // 256 * 256,
            moe_intermediate_size=args.expert_intermediate,
            num_experts=args.experts,
            num_experts_per_tok=args.experts_per_token,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 128,
            num_key_value_heads=args.hidden // 128,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 8 * args.hidden // 3 // 256 * 256,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def make(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(args), dtype=torch.float32)
    with torch.no_grad():  # norm weights are ones at init: make every tensor visibly its own
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(args.folder, max_shard_size=args.shard_size)
    numel = sum(p.numel() for p in model.parameters())
    Path(args.folder, "numel.json").write_text(json.dumps({"numel": numel, "vocab": args.vocab}))


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(7))


def stage3_config(optimizer: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "zero_optimization": {"stage": 3},
    }
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    return cfg


def load_zeroshard(folder: str, optimizer: bool) -> Any:
    from transformers import AutoModelForCausalLM

    import zeroshard

    with zeroshard.zero_init():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    engine, *_ = zeroshard.initialize(model=model, config=stage3_config(optimizer))
    return engine


def load_transformers(folder: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def load_deepspeed(folder: str, keep: list[Any]) -> Any:
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    cfg = stage3_config(optimizer=False)
    keep.append(HfDeepSpeedConfig(cfg))  # must stay alive: transformers looks it up through a weak reference
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # a load that silently skipped zero.Init would hold whole tensors here: say so in the row
    keep.append(all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()))
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def load(args: argparse.Namespace) -> None:
    # imports stay out of the timed part and under the baseline VmHWM: the library, and the Llama modeling
    # module that transformers would otherwise import lazily inside from_pretrained (seconds on this machine)
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    if args.variant == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig  # noqa: F401

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zeroshard  # noqa: F401

        dist.init_process_group("gloo")
    rank = dist.get_rank()
    keep: list[Any] = []
    fields = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    imported = {field: status(field) for field in fields}
    dist.barrier()
    start = time.perf_counter()
    if args.variant == "transformers":
        model = load_transformers(args.folder)
    elif args.variant == "deepspeed":
        model = load_deepspeed(args.folder, keep)
    else:
        model = load_zeroshard(args.folder, optimizer=args.variant == "zeroshard-adamw")
    own_seconds = time.perf_counter() - start
    dist.barrier()
    seconds = time.perf_counter() - start
    loaded = {field: status(field) for field in fields}

    # transformers maps the safetensors files and its fp32 parameters can be views of the mapping: pages are
    # read on first touch, so the first forward is where such a load finishes; timed and measured apart
    vocab = json.loads(Path(args.folder, "numel.json").read_text())["vocab"]
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(batch(vocab)).logits
    dist.barrier()
    forward_seconds = time.perf_counter() - start
    forwarded = {field: status(field) for field in fields}
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():  # the steady state, to tell what the first forward paid for the load
        model(batch(vocab))
    dist.barrier()
    second_forward_seconds = time.perf_counter() - start
    out = Path(args.out)
    if rank == 0:
        torch.save(logits.detach().clone(), out / f"{args.variant}-logits.pt")
    row = {
        "variant": args.variant,
        "rank": rank,
        "world_size": dist.get_world_size(),
        "seconds": seconds,
        "own_seconds": own_seconds,
        "forward_seconds": forward_seconds,
        "second_forward_seconds": second_forward_seconds,
        "vmhwm_after_imports": imported["VmHWM"],
        "after_imports": imported,
        "vmhwm_peak": loaded["VmHWM"],
        "after_load": loaded,
        "after_forward": forwarded,
        "pid": os.getpid(),
        "deepspeed_partitioned": keep[-1] if args.variant == "deepspeed" else None,
    }
    (out / f"{args.variant}-rank{rank}.json").write_text(json.dumps(row, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="save a synthetic sharded fp32 Llama checkpoint")
    mk.add_argument("--folder", required=True)
    mk.add_argument("--layers", type=int, default=16)
    mk.add_argument("--hidden", type=int, default=1536)
    mk.add_argument("--intermediate", type=int, default=0, help="0: 8/3 of hidden, rounded down to 256")
    mk.add_argument("--vocab", type=int, default=32000)
    mk.add_argument("--shard-size", default="500MB")
    mk.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE with this many experts per layer (0: Llama)")
    mk.add_argument("--experts-per-token", type=int, default=2)
    mk.add_argument("--expert-intermediate", type=int, default=512)
    ld = sub.add_parser("load", help="time one variant's load (under torchrun)")
    ld.add_argument("--variant", choices=VARIANTS, required=True)
    ld.add_argument("--folder", required=True)
    ld.add_argument("--out", required=True, help="folder for the per-rank JSON rows and rank 0's logits")
    args = parser.parse_args(argv)
    make(args) if args.command == "make" else load(args)


if __name__ == "__main__":
    main()
