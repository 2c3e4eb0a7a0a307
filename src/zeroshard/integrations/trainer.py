"""The `zeroshard train` loop: build, train with periodic logging/eval/checkpoints, export, sample.

    options = TrainOptions(model=ModelSpec("tiny-llama"), data=DataSpec(None), hyper=..., ds_config="zero2")
    result = train(options)   # on every rank (torchrun), or as one process

Every rank runs the same sequence of collectives: steps advance in lockstep, logging reduces the
loss at the same steps, evaluation gives every rank the same number of forward passes.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zeroshard.integrations.checkpoints import Checkpointer, LoopPosition
from zeroshard.integrations.ds_config import TrainHyper, train_ds_config
from zeroshard.integrations.export import (
    export_hf_folder,
    gathered_fp32_state_dict,
    load_exported,
    probe_logits,
    sample,
)
from zeroshard.integrations.hf_models import ModelSpec, build_model, tokenizer_source
from zeroshard.integrations.metrics import MetricsWriter, Progress, rss_bytes
from zeroshard.integrations.text_data import DataSpec, TokenBlocks, read_documents, split_blocks
from zeroshard.integrations.tokenizer import encode_documents, load_tokenizer
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

PROBE_TOKENS = 32


@dataclass(frozen=True)
class TrainOptions:
    model: ModelSpec
    data: DataSpec
    hyper: TrainHyper
    ds_config: str  # a preset name or a JSON file
    seq_len: int = 128
    output_dir: str = "runs/zeroshard"
    eval_fraction: float = 0.05
    eval_steps: int = 0  # 0: evaluate only at the end
    eval_batches: int = 20  # per rank, per evaluation
    save_steps: int = 0  # 0: no periodic checkpoints
    resume: str | None = None  # "auto" or a checkpoint folder
    log_steps: int = 10
    stop_after: int | None = None  # end this invocation after this many steps (resume later); None: run to max
    seed: int = 0
    sample_prompt: str = "def "
    sample_tokens: int = 48  # 0: no sample
    progress_bar: bool | None = None  # None: when stderr is a terminal
    export: bool = True


@dataclass
class TrainResult:
    steps: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float = 0.0
    elapsed_s: float = 0.0
    export_folder: str | None = None
    adapter_folder: str | None = None
    probe_max_abs_diff: float | None = None
    sample: str | None = None
    checkpoints: bool = False  # whether this run writes them (--save-steps)
    memory: dict[str, int] = field(default_factory=dict)


class LossWindow:
    """Micro-batch losses since the last log line, averaged over all ranks when read. They are summed on the device
    (in float64, as Python's floats summed them): reading each one waited for the GPU every micro-step."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, loss: torch.Tensor) -> None:
        value = loss.detach().reshape(()).to(torch.float64)
        self.total = value if self.total is None else self.total + value
        self.count += 1

    def mean(self, engine: Any) -> float:
        total = torch.zeros((), dtype=torch.float64) if self.total is None else self.total
        count = torch.tensor(float(self.count), dtype=torch.float64)
        t = torch.stack([total.to(engine.device), count.to(engine.device)])
        engine.comm.all_reduce(t)
        self.total, self.count = None, 0
        return float(t[0] / t[1]) if t[1] > 0 else math.nan


def train(opts: TrainOptions) -> TrainResult:
    """Run a whole training job on this rank; returns what rank 0 reports (other ranks: partial)."""
    from zeroshard.launcher.rendezvous import init_process_group_from_env, restart_count, under_torchrun

    if under_torchrun():
        init_process_group_from_env("nccl" if torch.cuda.is_available() else "gloo")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(opts.seed)
    tokenizer = load_tokenizer(tokenizer_source(opts.model))
    model = build_model(opts.model, tokenizer, opts.seq_len)
    tokens = encode_documents(tokenizer, read_documents(opts.data))
    train_set, eval_set = split_blocks(tokens, opts.seq_len, opts.eval_fraction)
    config = train_ds_config(opts.ds_config, opts.hyper, world_size)
    counts = _parameter_counts(model)  # before initialize: stage 3 leaves only shards in the module
    engine = _initialize(model, train_set, config)
    rank0 = engine.global_rank == 0
    if rank0:
        os.makedirs(opts.output_dir, exist_ok=True)
        with open(os.path.join(opts.output_dir, "ds_config.json"), "w", encoding="utf-8") as handle:
            json.dump(engine.config.to_dict(include_defaults=False), handle, indent=2)
    checkpointer = Checkpointer(engine, os.path.join(opts.output_dir, "checkpoints"))
    position = checkpointer.resume(opts.resume, restarted=restart_count() > 0) or LoopPosition()
    result = TrainResult(checkpoints=opts.save_steps > 0)
    metrics = MetricsWriter(opts.output_dir, enabled=rank0, resumed_at=engine.global_steps)
    progress = Progress(opts.hyper.max_steps, engine.global_steps, enabled=rank0, bar=opts.progress_bar)
    progress.line(_banner(engine, counts, train_set, eval_set, opts))
    try:
        _loop(engine, opts, train_set, eval_set, position, checkpointer, metrics, progress, result)
        result.eval_loss = evaluate(engine, eval_set, opts.eval_batches)
        if result.eval_loss is not None:
            metrics.write({"step": engine.global_steps, "eval_loss": result.eval_loss})
        progress.line(f"final eval loss {_fmt(result.eval_loss)}")
        # the last step's checkpoint, unless --save-steps wrote it; a run ended by --stop-after before max_steps saves
        # one whatever --save-steps says, for --resume to go on from (it restarted at step 0)
        stopped = engine.global_steps < opts.hyper.max_steps
        saved = opts.save_steps > 0 and engine.global_steps % opts.save_steps == 0
        if (opts.save_steps > 0 or stopped) and not saved:
            checkpointer.save(position)
            result.checkpoints = True
        report = engine.memory_report()
        result.memory = report.to_dict()
        progress.line(f"rank {report.rank} memory: {report.summary()}")
        if opts.export:
            _finish(engine, model, tokenizer, eval_set, opts, result, progress)
    finally:
        progress.close()
        metrics.close()
    if rank0:
        with open(os.path.join(opts.output_dir, "summary.json"), "w", encoding="utf-8") as handle:
            json.dump(asdict(result), handle, indent=2)
    engine.destroy()
    if torch.distributed.is_initialized():  # a clean exit: gloo can abort at interpreter shutdown otherwise
        torch.distributed.destroy_process_group()
    return result


def _initialize(model: torch.nn.Module, train_set: TokenBlocks, config: dict[str, Any]) -> Any:
    import zeroshard

    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=trainable, training_data=train_set, config=config
    )
    return engine


def _loop(
    engine: Any,
    opts: TrainOptions,
    train_set: TokenBlocks,
    eval_set: TokenBlocks,
    position: LoopPosition,
    checkpointer: Checkpointer,
    metrics: MetricsWriter,
    progress: Progress,
    result: TrainResult,
) -> None:
    window = LossWindow()
    start, start_step = time.perf_counter(), engine.global_steps
    tokens_per_step = engine.train_batch_size() * opts.seq_len
    last = opts.hyper.max_steps if opts.stop_after is None else min(opts.hyper.max_steps, start_step + opts.stop_after)
    for batch in _batches(engine, position, last):
        before = engine.global_steps
        batch = batch.to(engine.device)
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        window.add(loss)
        position.batches_in_epoch += 1
        if engine.global_steps == before:
            continue
        step = engine.global_steps
        row: dict[str, Any] = {"step": step, "epoch": position.epoch}
        if step % opts.log_steps == 0 or step == last or step == start_step + 1:
            elapsed = time.perf_counter() - start
            states, rss = _per_rank_memory(engine)
            row.update(_log_row(engine, window, step - start_step, tokens_per_step, elapsed, states, rss))
            result.first_loss = row["loss"] if result.first_loss is None else result.first_loss
            result.final_loss, result.tokens_per_s, result.elapsed_s = row["loss"], row["tokens_per_s"], elapsed
            progress.line(_log_line(row, opts.hyper.max_steps, states, rss))
        if opts.eval_steps > 0 and step % opts.eval_steps == 0 and step != opts.hyper.max_steps:
            row["eval_loss"] = evaluate(engine, eval_set, opts.eval_batches)
            progress.line(f"step {step:>6}  eval loss {_fmt(row['eval_loss'])}")
        if "loss" in row or "eval_loss" in row:
            metrics.write(row)
        if opts.save_steps > 0 and step % opts.save_steps == 0:
            checkpointer.save(position)
        progress.advance({"loss": _fmt(result.final_loss), "lr": f"{engine.get_lr()[0]:.2e}"})
    result.steps = engine.global_steps


def _batches(engine: Any, position: LoopPosition, max_steps: int) -> Iterator[torch.Tensor]:
    """Micro-batches until step `max_steps`, continuing from `position` (epoch, batches done)."""
    loader = engine.training_dataloader
    # A resumable sampler was put back at its position by load_checkpoint; a plain one starts the epoch over.
    skip = 0 if hasattr(loader.sampler, "load_state_dict") else position.batches_in_epoch
    while engine.global_steps < max_steps:
        loader.sampler.set_epoch(position.epoch)
        for index, batch in enumerate(loader):
            if index < skip:
                continue
            yield batch
            if engine.global_steps >= max_steps:  # steps only advance on accumulation boundaries
                return
        position.epoch += 1
        position.batches_in_epoch = skip = 0


def _log_row(
    engine: Any, window: LossWindow, steps: int, tokens_per_step: int, elapsed: float, states: list[int], rss: list[int]
) -> dict[str, Any]:
    return {
        "loss": window.mean(engine),
        "lr": engine.get_lr()[0],
        "grad_norm": None if (norm := engine.get_global_grad_norm()) is None else norm.item(),
        "tokens": engine.global_steps * tokens_per_step,
        "tokens_per_s": steps * tokens_per_step / max(elapsed, 1e-9),
        "model_states_mib_max": max(states) / 2**20,
        "rss_mib_max": max(rss) / 2**20,
        "elapsed_s": elapsed,
    }


def _per_rank_memory(engine: Any) -> tuple[list[int], list[int]]:
    """Every rank's model-state bytes (memory_report) and resident memory, gathered."""
    mine = torch.tensor([engine.memory_report().model_states, rss_bytes()], dtype=torch.float64, device=engine.device)
    every = torch.empty(2 * engine.world_size, dtype=torch.float64, device=engine.device)
    engine.comm.all_gather(every, mine)
    pairs = every.view(-1, 2).cpu().tolist()
    return [int(s) for s, _ in pairs], [int(r) for _, r in pairs]


def _log_line(row: dict[str, Any], max_steps: int, states: list[int], rss: list[int]) -> str:
    per_rank_states = "|".join(f"{s / 2**20:.1f}" for s in states)
    per_rank_rss = "|".join(f"{r / 2**20:.0f}" for r in rss)
    return (
        f"step {row['step']:>6}/{max_steps}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
        f"{row['tokens_per_s']:,.0f} tok/s  model states {per_rank_states} MiB/rank  rss {per_rank_rss} MiB/rank"
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


@torch.no_grad()
def evaluate(engine: Any, eval_set: TokenBlocks, max_batches: int) -> float | None:
    """Mean loss over this run's held-out blocks (each rank takes every world_size-th block)."""
    n = len(eval_set)
    if n == 0:
        return None
    world, rank = engine.world_size, engine.global_rank
    micro = engine.train_micro_batch_size_per_gpu()
    mine = list(range(rank, n, world))
    rounds = min(max_batches, math.ceil(math.ceil(n / world) / micro))  # the same on every rank
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    engine.eval()
    try:
        for r in range(rounds):
            chunk = mine[r * micro : (r + 1) * micro]
            ids = torch.stack([eval_set[i] for i in (chunk or [0])]).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss  # ranks without data still run the forward
            if chunk:  # summed on the device: no wait for the GPU per batch
                count = torch.tensor(float(len(chunk)), dtype=torch.float64, device=totals.device)
                totals += torch.stack([loss.detach().reshape(()).to(torch.float64) * count, count])
    finally:
        engine.train()
    engine.comm.all_reduce(totals)
    return float(totals[0] / totals[1])


def _finish(
    engine: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    eval_set: TokenBlocks,
    opts: TrainOptions,
    result: TrainResult,
    progress: Progress,
) -> None:
    """Export the Hugging Face folder, check it against the engine's logits, and print a sample."""
    probe_source = eval_set if len(eval_set) else None
    probe = (probe_source[0][:PROBE_TOKENS] if probe_source is not None else torch.arange(PROBE_TOKENS) % 200 + 3)[None]
    engine.eval()
    engine_logits = probe_logits(engine, probe.to(engine.device))  # every rank: a collective under stage 3
    state = gathered_fp32_state_dict(engine, keep=engine.global_rank == 0)
    if engine.global_rank != 0:
        return
    folder = os.path.join(opts.output_dir, "final")
    result.adapter_folder = export_hf_folder(model, state, tokenizer, folder)
    result.export_folder = folder
    torch.save({"input_ids": probe, "logits": engine_logits}, os.path.join(opts.output_dir, "export_probe.pt"))
    exported = load_exported(folder)
    result.probe_max_abs_diff = float((probe_logits(exported, probe) - engine_logits).abs().max())
    progress.line(f"exported {folder}: max |logits - engine logits| = {result.probe_max_abs_diff:.2e}")
    if result.adapter_folder:
        progress.line(f"LoRA adapter saved to {result.adapter_folder}")
    if opts.sample_tokens > 0:
        result.sample = sample(exported, tokenizer, opts.sample_prompt, opts.sample_tokens, opts.seed)
        progress.line(f"sample: {result.sample!r}")
    engine.train()


def _parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters, tied weights once."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    trainable = sum({id(p): p.numel() for p in model.parameters() if p.requires_grad}.values())
    return total, trainable


def _banner(
    engine: Any, counts: tuple[int, int], train_set: TokenBlocks, eval_set: TokenBlocks, opts: TrainOptions
) -> str:
    total, trainable = counts
    dtype = str(engine.precision.compute_dtype).removeprefix("torch.")
    backend = " on FSDP2" if engine.config.zeroshard.backend == "fsdp2" else ""
    return (
        f"zeroshard train: {opts.model.name} ({total:,} parameters, {trainable:,} trainable), ZeRO stage "
        f"{engine.zero_stage}{backend}, {dtype}, {engine.world_size} rank(s) on {engine.device.type}; "
        f"{len(train_set)} train / {len(eval_set)} eval blocks of {opts.seq_len} tokens; "
        f"batch {engine.train_batch_size()} = {engine.train_micro_batch_size_per_gpu()} x "
        f"{engine.gradient_accumulation_steps()} x {engine.world_size}; {opts.hyper.max_steps} steps"
    )
