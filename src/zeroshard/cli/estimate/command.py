"""`zeroshard estimate --model NAME_OR_FOLDER | --params 7e9 [--gpus N] [--nodes K] [--json]`."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

from zeroshard.cli.common import EXIT_CONFIG, CLIError, human_bytes, out
from zeroshard.cli.estimate.activations import activation_bytes
from zeroshard.cli.estimate.formulas import Cluster, Precision
from zeroshard.cli.estimate.recommend import Recommendation, recommend
from zeroshard.cli.estimate.rows import DEFAULT_BUCKET_NUMEL, Row, estimate_rows
from zeroshard.cli.estimate.shapes import ATTENTION, ModelInfo, from_model_arg, from_params
from zeroshard.precision.dtypes import DTYPES, bytes_of

# fp32 state bytes per trainable element; Muon's momentum on its matrices, Adam's moments on the rest (MUON_SPLIT)
OPTIMIZER_STATE_BYTES = {
    "adamw": 8,
    "adam": 8,
    "lamb": 8,
    "lion": 4,
    "sgd": 4,
    "adagrad": 4,
    "sgd-nomomentum": 0,
    "muon": 4,
}
MUON_SPLIT = ("muon", "adamw")
DEFAULT_GPU_GIB = 80.0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "estimate",
        parents=parents,
        help="per-rank memory of each ZeRO stage and offload choice, and a recommendation",
        description="Estimate per-rank GPU and per-node CPU memory for every ZeRO stage x offload option "
        "(zeroshard's accounting, DeepSpeed's formulas beside it) plus activations, and recommend one.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a Hugging Face model folder or a built-in config name (e.g. llama-2-7b)")
    what.add_argument("--params", type=float, help="number of parameters, e.g. 7e9 (a Llama-like shape is assumed)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (ranks) per node (default: CUDA devices here, or 1)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="sequence length for the activation estimate")
    p.add_argument("--micro-batch", type=int, default=1, help="micro-batch per rank for the activation estimate")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (stage 3's gradient dtype)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="training dtype (default bf16)")
    p.add_argument(
        "--grad-dtype",
        choices=sorted(DTYPES),
        default=None,
        help="gradient accumulation dtype (default fp32; bf16 with --bf16-master-weights)",
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STATE_BYTES),
        default="adamw",
        help="its state bytes (default adamw); muon: momentum on the matrices (2+ dims, names without embed/lm_head), "
        "Adam's moments on the rest, in the model's proportion (also for --trainable)",
    )
    p.add_argument(
        "--bf16-master-weights",
        action="store_true",
        help="bf16.bf16_master_weights_and_grads: bf16 master weights and gradients (with --dtype bf16)",
    )
    p.add_argument(
        "--bf16-optimizer-states",
        action="store_true",
        help="bf16.bf16_optimizer_states: optimizer state in bf16 (with --bf16-master-weights)",
    )
    p.add_argument(
        "--trainable",
        type=float,
        default=None,
        help="trainable parameters, a count (2e7) or a fraction of the model (0.02), the rest frozen: LoRA or a "
        "partly frozen model (default: all train)",
    )
    p.add_argument(
        "--quantized-frozen",
        action="store_true",
        help="zero_optimization.zero_quantized_nontrainable_weights: stage 3 holds the frozen weights as int8 blocks "
        "(with --trainable)",
    )
    p.add_argument(
        "--autoep-size",
        type=int,
        default=1,
        help="expert_parallel.autoep_size: the model's routed experts split over this many ranks (stages 1-3)",
    )
    p.add_argument("--gradient-checkpointing", action="store_true", help="activations with recomputation")
    p.add_argument(
        "--attn-implementation",
        choices=ATTENTION,
        default=None,
        help="attention as training sets it (from_pretrained's attn_implementation; default: the model's own): eager "
        "keeps each layer's seq x seq scores, the fused kernels do not",
    )
    p.add_argument("--bucket-size", type=float, default=DEFAULT_BUCKET_NUMEL, help="reduce_bucket_size (elements)")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (default: this GPU, or 80)")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows (and nothing else)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for name in ("gpus", "nodes", "seq_len", "micro_batch", "grad_accum"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} {value} must be >= 1")
    for name in ("params", "bucket_size", "gpu_memory"):  # floats: inf, nan and 0 parse too
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CLIError(f"--{name.replace('_', '-')} {value} must be a positive number", EXIT_CONFIG)
    attention = args.attn_implementation
    model = (
        from_model_arg(args.model, attention) if args.model else from_params(args.params, eager=attention == "eager")
    )
    trainable = _trainable(args.trainable, model.params)
    cluster = Cluster(gpus_per_node=args.gpus or _local_gpus(), nodes=args.nodes)
    _check_autoep(args.autoep_size, model, cluster)
    precision = _precision(args, model)
    rows = estimate_rows(
        model,
        cluster,
        precision,
        args.seq_len,
        args.micro_batch,
        args.gradient_checkpointing,
        int(args.bucket_size),
        args.grad_accum,
        trainable,
        args.autoep_size,
    )
    gpu_memory = int(args.gpu_memory * 2**30) if args.gpu_memory is not None else None
    gpu_memory = gpu_memory or _local_gpu_memory() or int(DEFAULT_GPU_GIB * 2**30)
    rec = recommend(
        model.params,
        rows,
        cluster,
        gpu_memory,
        lambda ckpt, mb: activation_bytes(model.shape, args.seq_len, mb, precision.param_bytes, ckpt),
        args.gradient_checkpointing,
        args.micro_batch,
    )
    if args.autoep_size > 1:
        rec = replace(rec, extra={"expert_parallel": {"enabled": True, "autoep_size": args.autoep_size}})
    if args.quantized_frozen and rec.option.stage == 3:  # the rows counted it: the config says it
        rec = replace(rec, zero_optimization={**rec.zero_optimization, "zero_quantized_nontrainable_weights": True})
    if args.json:
        out(json.dumps([_json_row(row, rec) for row in rows], indent=2))
    else:
        out(render(model, cluster, args, rows, rec, gpu_memory))
    return 0


def _check_autoep(size: int, model: ModelInfo, cluster: Cluster) -> None:
    if size == 1:
        return
    if size < 1 or not model.experts:
        why = "must be >= 1" if size < 1 else "needs a model with fused experts (--model of a transformers MoE model)"
        raise CLIError(f"--autoep-size {size} {why}", EXIT_CONFIG)
    if cluster.world_size % size or model.num_experts % size:
        raise CLIError(
            f"--autoep-size {size} must divide the ranks ({cluster.world_size}) and the experts per layer "
            f"({model.num_experts})",
            EXIT_CONFIG,
        )


def _precision(args: argparse.Namespace, model: ModelInfo) -> Precision:
    """Bytes per element from the dtype flags; `args.grad_dtype` is resolved in place (for the header)."""
    if args.optimizer == "muon" and args.bf16_master_weights:
        raise CLIError("--optimizer muon needs fp32 master weights (drop --bf16-master-weights)", EXIT_CONFIG)
    if args.bf16_master_weights and args.dtype != "bf16":
        raise CLIError(f"--bf16-master-weights needs --dtype bf16 (it is {args.dtype})", EXIT_CONFIG)
    if args.bf16_optimizer_states and not args.bf16_master_weights:
        raise CLIError("--bf16-optimizer-states needs --bf16-master-weights", EXIT_CONFIG)
    if args.grad_dtype is None:
        args.grad_dtype = "bf16" if args.bf16_master_weights else "fp32"
    if args.quantized_frozen and args.trainable is None:
        raise CLIError("--quantized-frozen needs --trainable (the frozen parameters it quantizes)", EXIT_CONFIG)
    state: float = OPTIMIZER_STATE_BYTES[args.optimizer] // (2 if args.bf16_optimizer_states else 1)
    if args.optimizer == "muon":
        matrix, rest = (OPTIMIZER_STATE_BYTES[name] for name in MUON_SPLIT)
        state = (matrix * model.matrices + rest * (model.params - model.matrices)) / model.params
    master = 2 if args.bf16_master_weights else 4
    return Precision(
        bytes_of(args.dtype),
        bytes_of(args.grad_dtype),
        state,
        master_bytes=master,
        quantized_frozen=args.quantized_frozen,
    )


def _trainable(value: float | None, params: int) -> int | None:
    """`--trainable` as a count of parameters (a value below 1 is a fraction of `params`)."""
    if value is None:
        return None
    count = round(value * params) if value < 1 else round(value)
    if not 0 < count <= params:
        raise CLIError(f"--trainable {value:g} must be a fraction in (0, 1) or a count in [1, {params:,}]", EXIT_CONFIG)
    return count


def _json_row(row: Row, rec: Recommendation) -> dict[str, Any]:
    data = row.to_json()
    data["recommended"] = row.option == rec.option
    if data["recommended"]:
        data["recommendation"] = rec.to_json()
    return data


def render(
    model: ModelInfo, cluster: Cluster, args: argparse.Namespace, rows: list[Row], rec: Recommendation, gpu_memory: int
) -> str:
    s = model.shape
    lines = [
        f"model: {model.name}: {model.params:,} parameters, largest layer {model.largest_layer:,}; "
        f"hidden {s.hidden}, {s.layers} layers, vocabulary {s.vocab}",
    ]
    if model.assumed:
        lines.append(f"  ({model.assumed})")
    trainable = _trainable(args.trainable, model.params)
    if trainable is not None and trainable < model.params:
        lines.append(
            f"  {trainable:,} trainable ({trainable / model.params:.2%}); the other {model.params - trainable:,} "
            f"frozen: {args.dtype} weights only, no gradient, master or optimizer state"
            + (
                "; at stage 3 held as int8 blocks (zero_quantized_nontrainable_weights)"
                if args.quantized_frozen
                else ""
            )
        )
    if args.autoep_size > 1:
        lines.append(
            f"  {model.experts:,} in routed experts ({model.experts / model.params:.1%}) split over "
            f"{args.autoep_size} ranks (expert_parallel; stages 1-3), each expert data-parallel over "
            f"{cluster.world_size // args.autoep_size}"
        )
    lines += [
        f"cluster: {cluster.nodes} node(s) x {cluster.gpus_per_node} GPU(s) = {cluster.world_size} ranks; "
        f"{args.dtype} parameters, {'bf16' if args.bf16_master_weights else 'fp32'} master weights, "
        f"{args.grad_dtype} gradient accumulation ({args.grad_accum} micro-steps), "
        f"{_optimizer_label(args, model)}; "
        f"activations for micro-batch {args.micro_batch} x {args.seq_len} tokens"
        + (" with checkpointing" if args.gradient_checkpointing else ""),
        "",
        f"{'option':<54}{'GPU/rank':>11}{'states':>11}{'activ.':>11}{'buffers':>11}"
        f"{'CPU/node':>11}{'NVMe/node':>11}  | DeepSpeed GPU/rank, CPU/node",
    ]
    same_levers = rec.checkpointing == args.gradient_checkpointing and rec.micro_batch == args.micro_batch
    for row in rows:
        mark = (" *" if same_levers else " +")[1] if row.option == rec.option else " "
        ds = "-" if row.deepspeed is None else f"{human_bytes(row.deepspeed[1])}, {human_bytes(row.deepspeed[0])}"
        lines.append(
            f"{mark} {row.option.label():<52}{human_bytes(row.gpu_bytes_per_rank):>11}"
            f"{human_bytes(row.states.gpu):>11}{human_bytes(row.activation_bytes):>11}"
            f"{human_bytes(row.buffer_bytes):>11}{human_bytes(row.cpu_bytes_per_node):>11}"
            f"{human_bytes(row.nvme_bytes_per_node):>11}  | {ds}"
        )
    if not same_levers:
        lines.append("+ recommended with other levers (checkpointing, micro-batch): its GPU bytes are below")
    ratio = rec.zero_optimization.get("offload_optimizer", {}).get("ratio")
    what = f"{rec.option.label()}{'' if ratio is None else f' (ratio {ratio:g})'} (micro-batch {rec.micro_batch}" + (
        ", activation checkpointing)" if rec.checkpointing else ")"
    )
    if rec.tree_option is None:
        lines += ["", f"recommended (seed-000 decision tree): {what}"]
    elif rec.fits:
        lines += ["", f"recommended (fits; the seed-000 decision tree's {rec.tree_option.label()} does not): {what}"]
    else:
        lines += ["", f"NOTHING FITS in {human_bytes(gpu_memory)} per GPU; the smallest: {what}"]
    lines += [f"  - {reason}" for reason in rec.reasons]
    lines += [f"  - {note}" for note in rec.notes]
    config = {"train_micro_batch_size_per_gpu": rec.micro_batch, "zero_optimization": rec.zero_optimization}
    config |= rec.extra
    lines.append(f"  ds_config{'' if rec.fits is not False else ' (does not fit)'}: {json.dumps(config)}")
    return "\n".join(lines)


def _optimizer_label(args: argparse.Namespace, model: ModelInfo) -> str:
    if args.optimizer == "muon":
        return f"muon (momentum on the {model.matrices / model.params:.1%} in matrices, Adam on the rest)"
    return f"{args.optimizer}{' (bf16 state)' if args.bf16_optimizer_states else ''}"


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _local_gpu_memory() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)
