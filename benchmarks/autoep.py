"""AutoEP (`expert_parallel`, ZeRO-2 and ZeRO-3) against replicated experts, ZeRO-3, FSDP2, DDP and DeepSpeed's
AutoEP (ZeRO-2 and ZeRO-3), in one run.

    python -m benchmarks.autoep [--steps 4] [--variants a,b]   (the table of docs/benchmarks_autoep.md, ~1 min)

A DeepSeek-V3-shaped model from its config (`_model`: 4 layers, the first dense, 16 routed experts of which each
token takes 4, one shared expert, latent attention; 12.1M parameters, 78% of them routed experts), fp32, AdamW,
clipping at 1.0, 2 gloo ranks with one thread each, micro-batch 2 of 128 tokens per rank. DeepSeek-V3 because
DeepSpeed 0.19.8's AutoEP runs it with transformers 5.24 (its Mixtral and Qwen presets fail at initialize). Each
variant runs in fresh processes (`run_on_ranks`), so VmHWM is that variant's own peak. Per rank:
- step time: the mean of the timed steps (after a warm-up step and the counted one), the slowest rank's; tokens/s
  from it;
- bytes: what one step (the second) puts on the wire, counted the same way for every framework by `C10dBytes`, a
  dispatch mode that sees every c10d collective (ring-model bus bytes: S(N-1)/N, twice for an all-reduce; an
  all-to-all counts the rows it sends to other ranks), in three columns: the token exchange, gathers (all-gathers,
  and the broadcasts zeroshard gathers with on gloo) and reductions (reduce-scatters, all-reduces, and the reduces
  zeroshard reduce-scatters with on gloo);
- RSS growth (VmRSS after the steps minus before building the model) and VmHWM, from /proc/self/status;
- rank 0's first losses (the zeroshard rows train the same model: equal to 1e-6; DeepSpeed routes with its own
  re-implementation, DDP's mean is the same math).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.machine import describe
from benchmarks.resident_memory import proc_status

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.harness import run_on_ranks  # noqa: E402

MiB = 1 << 20
MICRO, SEQ, VOCAB = 2, 128, 2048
# name: (framework, ZeRO stage, autoep_size)
VARIANTS = {
    "zeroshard ZeRO-2 + AutoEP 2": ("zeroshard", 2, 2),
    "zeroshard ZeRO-2 (experts replicated)": ("zeroshard", 2, 1),
    "zeroshard ZeRO-3 + AutoEP 2": ("zeroshard", 3, 2),
    "zeroshard ZeRO-3": ("zeroshard", 3, 1),
    "FSDP2 (zeroshard fsdp2 backend)": ("fsdp2", 3, 1),
    "DDP": ("ddp", 0, 1),
    "DeepSpeed ZeRO-2 + AutoEP 2": ("deepspeed", 2, 2),
    "DeepSpeed ZeRO-2 (experts replicated)": ("deepspeed", 2, 1),
    "DeepSpeed ZeRO-3 + AutoEP 2": ("deepspeed", 3, 2),
}


def _model() -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=SEQ,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config)


# c10d op -> (kind, factor, index of the argument whose bytes are the whole message S, index of the process group)
_RING = {
    "allreduce_": ("all_reduce", 2.0, 0, 1),
    "allreduce_coalesced_": ("all_reduce", 2.0, 0, 1),
    "_allgather_base_": ("all_gather", 1.0, 0, 2),
    "allgather_": ("all_gather", 1.0, 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 1.0, 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1.0, 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1.0, 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1.0, 1, 2),
    "broadcast_": ("broadcast", 1.0, 0, 1),
    "reduce_": ("reduce", 1.0, 0, 1),
}
# the table's columns: zeroshard's gloo path gathers by broadcasts and reduce-scatters by reduces (in place: [Note:
# gloo in place] in comm/collectives.py), the same bus bytes as the ring collectives
COLUMNS = {"all_to_all": ("all_to_all",), "gathers": ("all_gather", "broadcast"),
           "reductions": ("reduce_scatter", "reduce", "all_reduce")}  # fmt: skip


def _group(boxed: Any) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroup.unbox(boxed) if isinstance(boxed, torch.ScriptObject) else boxed


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class C10dBytes(TorchDispatchMode):
    """Bus bytes per kind of every c10d collective issued inside it (whatever framework issues it)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: dict[str, float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace != "c10d" or not (name in _RING or name == "alltoall_base_"):
            return out
        if name == "alltoall_base_":  # (output, input, group, output splits, input splits, ...)
            group = _group(args[2])
            n, rows = group.size(), args[1].shape[0]
            splits = list(args[4]) or [rows // n] * n  # rows sent to each rank
            row_bytes = _bytes(args[1]) // max(1, rows)
            self._add("all_to_all", float(row_bytes * (sum(splits) - splits[group.rank()])))
        else:
            kind, factor, index, at = _RING[name]
            n = _group(args[at]).size()
            self._add(kind, factor * _bytes(args[index]) * (n - 1) / n)
        return out

    def _add(self, kind: str, value: float) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0.0) + value


def _engine(framework: str, stage: int, ep: int, model: torch.nn.Module) -> tuple[Any, Any]:
    """(object to call forward on, the step: backward + optimizer step)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage},
    }
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    if framework == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

        def step(loss: torch.Tensor) -> None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return ddp, step
    if framework == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config)
    else:
        import zeroshard

        if framework == "fsdp2":
            config["zeroshard"] = {"backend": "fsdp2"}
        engine, *_ = zeroshard.initialize(model=model, config=config)

    def engine_step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return engine, engine_step


def measure(rank: int, world: int, variant: str, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import zeroshard

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    framework, stage, ep = VARIANTS[variant]
    before = proc_status("VmRSS")
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    forward, step = _engine(framework, stage, ep, model)
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (world * MICRO, SEQ), generator=generator) for _ in range(steps + 2)]
    losses, times, counter = [], [], C10dBytes()
    for i, batch in enumerate(batches):  # a warm-up step, one counted step, then the timed ones (outside the mode)
        x = batch[rank * MICRO : (rank + 1) * MICRO]
        dist.barrier()
        start = time.perf_counter()
        with counter if i == 1 else contextlib.nullcontext():
            loss = forward(input_ids=x, labels=x).loss
            step(loss)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {
        "numel": numel,
        "time": statistics.mean(times[2:]),
        "bytes": dict(counter.kinds),
        "grown": proc_status("VmRSS") - before,
        "hwm": proc_status("VmHWM"),
        "losses": losses[:3],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.autoep", description=__doc__)
    p.add_argument("--steps", type=int, default=4, help="measured steps after one warm-up")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    args = p.parse_args(argv)
    machine = describe()
    versions = f"torch {machine['torch']}, deepspeed {machine.get('deepspeed')}"
    print(f"{machine['cpu']}, {machine['cores']} cores, {versions}, {machine['date']}\n")
    print("| variant | step s (vs row 1) | tokens/s | MB/step/rank: all_to_all | gathers | reductions | total "
          "| RSS growth MiB/rank (max) | VmHWM MiB (max) | losses (rank 0) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base = None
    for variant in args.variants.split(","):
        ranks = run_on_ranks(measure, 2, variant, args.steps, timeout=1800)
        seconds = max(r["time"] for r in ranks)
        base = base or seconds
        columns = [max(sum(r["bytes"].get(k, 0.0) for k in kinds) for r in ranks) for kinds in COLUMNS.values()]
        wire = " | ".join(f"{value / 1e6:.2f}" for value in [*columns, sum(columns)])
        print(
            f"| {variant} | {seconds:.3f} ({seconds / base:.2f}x) | {2 * MICRO * SEQ / seconds:,.0f} | {wire} "
            f"| {max(r['grown'] for r in ranks) / MiB:.0f} | {max(r['hwm'] for r in ranks) / MiB:.0f} "
            f"| {', '.join(f'{v:.6f}' for v in ranks[0]['losses'])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
