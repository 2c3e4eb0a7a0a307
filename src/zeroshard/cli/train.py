"""`zeroshard train`: fine-tune or pretrain a Hugging Face causal LM with ZeRO in one command.

    zeroshard train --nproc-per-node 2 --model tiny-llama --zero-stage 2 --max-steps 50
    zeroshard train --model ./my-llama --data corpus.jsonl --lora-rank 8 --ds-config zero2
    zeroshard launch --nproc_per_node 2 -m zeroshard.cli.train --model small-llama

With `--nproc-per-node N` (N > 1) the command re-launches itself through torchrun; under a launcher it
runs as one rank. Problems with the model, data or ds_config are reported before any process starts.
Outputs in --output-dir: metrics.csv, ds_config.json, summary.json, checkpoints/, final/ (a Hugging
Face folder), final-adapter/ (LoRA), export_probe.pt (the engine's logits on a fixed input).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from zeroshard.cli.common import EXIT_CONFIG, CLIError, add_subcommand

DEFAULT_MODEL = "small-llama"
DEFAULT_STAGE = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"HF model folder or built-in config (default {DEFAULT_MODEL})"
    )
    m.add_argument("--tokenizer", help="tokenizer folder (default: the model folder's, else byte-level)")
    m.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    m.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    m.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (peft); 0: full")
    m.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 2 x rank)")
    m.add_argument("--lora-dropout", type=float, default=0.0)
    m.add_argument(
        "--lora-targets",
        help="comma-separated module names (default: peft's for the model type, else q_proj,v_proj when present)",
    )
    d = p.add_argument_group("data")
    d.add_argument("--data", help="text/JSONL file or folder (default: the Python standard library's sources)")
    d.add_argument("--text-field", default="text", help="JSONL field holding the text (default 'text')")
    d.add_argument("--data-bytes", type=int, help="read at most this many characters (bundled corpus: 2M)")
    d.add_argument("--eval-fraction", type=float, default=0.05, help="held-out share of the blocks (default 0.05)")
    d.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (default: only at the end)")
    d.add_argument("--eval-batches", type=int, default=20, help="micro-batches per rank per evaluation")
    o = p.add_argument_group("optimization")
    o.add_argument("--max-steps", type=int, default=200, help="optimizer steps (default 200)")
    o.add_argument("--micro-batch", type=int, default=8, help="samples per rank per micro-step (default 8)")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    o.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default: 10%% of --max-steps)")
    o.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    o.add_argument("--seed", type=int, default=0)
    z = p.add_argument_group("ZeRO")
    z.add_argument("--ds-config", help="ds_config file or preset (zero0..zero3, zero2_offload, zero3_offload)")
    z.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help=f"preset stage (default {DEFAULT_STAGE})")
    z.add_argument("--offload", action="store_true", help="use the *_offload preset of the stage")
    z.add_argument(
        "--backend", choices=("zero", "fsdp2"), help='engine: "zero" (default) or "fsdp2" (PyTorch FSDP2, stages 2-3)'
    )
    z.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="auto: bf16 on CUDA (fp16 on GPUs without bf16), else fp32",
    )
    r = p.add_argument_group("output")
    r.add_argument("--output-dir", default="runs/zeroshard-train", help="where metrics, checkpoints, export go")
    r.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    r.add_argument(
        "--resume", nargs="?", const="auto", help="resume from --output-dir's latest checkpoint, or a folder"
    )
    r.add_argument("--log-steps", type=int, default=10, help="log line every N steps")
    r.add_argument("--stop-after", type=int, help="end this invocation after N steps (continue later with --resume)")
    r.add_argument("--sample-prompt", default="def ", help="prompt of the final sample generation")
    r.add_argument("--sample-tokens", type=int, default=48, help="tokens to generate at the end (0: none)")
    r.add_argument("--no-export", dest="export", action="store_false", help="skip the final Hugging Face export")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, help="progress bar (default: on a terminal)")
    n = p.add_argument_group("processes")
    n.add_argument("--nproc-per-node", type=int, default=1, help="processes to start through torchrun (default 1)")
    n.add_argument("--max-restarts", type=int, default=0, help="elastic restarts (resume from the latest checkpoint)")
    n.add_argument(
        "--local_rank", "--local-rank", type=int, help="given by `zeroshard launch` (as DeepSpeed's): the LOCAL_RANK"
    )


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = add_subcommand(
        sub, "train", parents, "train a Hugging Face causal LM with ZeRO (model folder or built-in config)", __doc__
    )
    add_arguments(p)
    p.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroshard train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def hyper_from_args(args: argparse.Namespace) -> Any:
    from zeroshard.integrations.ds_config import TrainHyper

    dtype = args.dtype
    if dtype == "auto":
        import torch

        # bf16 matmuls are far slower than fp32 on CPUs, and emulated (slow) on GPUs without bf16 units (V100, T4:
        # fp16 there, with its loss scaler)
        if not torch.cuda.is_available():
            dtype = "fp32"
        else:
            dtype = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    warmup = args.warmup_steps if args.warmup_steps is not None else args.max_steps // 10
    return TrainHyper(
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=warmup,
        max_steps=args.max_steps,
        max_grad_norm=args.max_grad_norm,
        dtype=dtype,
        backend=args.backend,
    )


def ds_config_source(args: argparse.Namespace) -> str:
    from zeroshard.integrations.ds_config import preset_name

    if args.ds_config is not None:
        if args.zero_stage is not None or args.offload:
            raise CLIError("--ds-config sets the stage and offload; leave out --zero-stage/--offload", EXIT_CONFIG)
        return str(args.ds_config)
    stage = DEFAULT_STAGE if args.zero_stage is None else args.zero_stage
    if args.offload and stage < 2:
        raise CLIError(
            f"--offload needs --zero-stage 2 or 3 (presets zero2_offload, zero3_offload), not {stage}", EXIT_CONFIG
        )
    return preset_name(stage, args.offload)


def options_from_args(args: argparse.Namespace) -> Any:
    from zeroshard.integrations.hf_models import LoraSpec, ModelSpec
    from zeroshard.integrations.text_data import DataSpec
    from zeroshard.integrations.trainer import TrainOptions

    _check_numbers(args)
    lora = None
    if args.lora_rank > 0:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()] if args.lora_targets else None
        lora = LoraSpec(args.lora_rank, args.lora_alpha or 2.0 * args.lora_rank, args.lora_dropout, targets)
    return TrainOptions(
        model=ModelSpec(args.model, args.tokenizer, args.gradient_checkpointing, lora),
        data=DataSpec(args.data, args.text_field, args.data_bytes),
        hyper=hyper_from_args(args),
        ds_config=ds_config_source(args),
        seq_len=args.seq_len,
        output_dir=args.output_dir,
        eval_fraction=args.eval_fraction,
        eval_steps=args.eval_steps,
        eval_batches=args.eval_batches,
        save_steps=args.save_steps,
        resume=args.resume,
        log_steps=args.log_steps,
        stop_after=args.stop_after,
        seed=args.seed,
        sample_prompt=args.sample_prompt,
        sample_tokens=args.sample_tokens,
        progress_bar=args.progress,
        export=args.export,
    )


def _check_numbers(args: argparse.Namespace) -> None:
    positive = ("seq_len", "max_steps", "micro_batch", "grad_accum", "log_steps", "eval_batches", "nproc_per_node")
    for name in (*positive, "stop_after"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1", EXIT_CONFIG)
    for name in ("eval_steps", "save_steps", "sample_tokens", "lora_rank", "max_restarts"):
        if getattr(args, name) < 0:
            raise CLIError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0", EXIT_CONFIG)
    if args.max_restarts > 0 and args.save_steps == 0:  # a restart resumes from the latest checkpoint
        raise CLIError(
            f"--max-restarts {args.max_restarts} needs --save-steps N: restarted ranks resume from the latest "
            "checkpoint in --output-dir, and without --save-steps none is written",
            EXIT_CONFIG,
        )
    if not 0.0 <= args.eval_fraction < 1.0:
        raise CLIError(f"--eval-fraction {args.eval_fraction} must be in [0, 1)", EXIT_CONFIG)
    if args.lr <= 0:
        raise CLIError(f"--lr {args.lr} must be positive", EXIT_CONFIG)


def preflight(args: argparse.Namespace, world_size: int) -> Any:
    """Check model, data and ds_config before starting any process; returns the TrainOptions."""
    from zeroshard.config import parse_config, resolve_config
    from zeroshard.integrations.ds_config import train_ds_config
    from zeroshard.integrations.hf_models import check_model
    from zeroshard.integrations.text_data import check_readable

    opts = options_from_args(args)
    check_model(opts.model)
    check_readable(opts.data)
    _check_writable(opts.output_dir)
    hidden = _hidden_size(opts.model.name)
    known = {"hidden_size": hidden} if hidden else {}
    config = train_ds_config(opts.ds_config, opts.hyper, world_size)
    with _quiet_config_logger():  # the run itself logs the same warnings once, from initialize
        resolve_config(parse_config(config), world_size=world_size, known=known)
    return opts


def _check_writable(output_dir: str) -> None:
    """The output directory (metrics, checkpoints, the export) can be created and written, before any rank starts; a
    folder the check made is removed again (a run refused after it left an empty one behind), the run makes it."""
    from zeroshard.utils.files import probe_writable

    try:
        probe_writable(output_dir, ".zeroshard-write-check-", keep=False)
    except OSError as err:
        raise CLIError(
            f"--output-dir {output_dir}: cannot write there ({err.strerror}); choose a writable directory", EXIT_CONFIG
        ) from None


@contextlib.contextmanager
def _quiet_config_logger() -> Iterator[None]:
    from zeroshard.utils.logging import get_logger

    logger = get_logger("zeroshard.config")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _hidden_size(model: str) -> int | None:
    from zeroshard.presets import MODEL_PRESETS

    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model].hidden_size
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as err:
        raise CLIError(f"--model {model}: cannot read config.json ({err})", EXIT_CONFIG) from None
    hidden = data.get("hidden_size") or data.get("n_embd")
    return hidden if isinstance(hidden, int) else None


def run(args: argparse.Namespace) -> int:
    from zeroshard.launcher.rendezvous import under_torchrun

    launching = args.nproc_per_node > 1 and not under_torchrun()
    given = os.environ.get("LOCAL_RANK", "0")
    if args.local_rank is not None and str(args.local_rank) != given:  # the device follows LOCAL_RANK
        raise CLIError(f"--local_rank {args.local_rank} but this process's LOCAL_RANK is {given}", EXIT_CONFIG)
    world_size = args.nproc_per_node if launching else int(os.environ.get("WORLD_SIZE", "1"))
    opts = preflight(args, world_size)
    if not under_torchrun():  # once, in the process the user started
        _warn_overridden(args, opts, world_size)
    if launching:
        from zeroshard.integrations.text_data import check_contents

        check_contents(opts.data)  # (the ranks read it anyway; the launcher reads it once first)
        return _relaunch(args)
    from zeroshard.integrations.trainer import train

    train(opts)
    return 0


def _warn_overridden(args: argparse.Namespace, opts: Any, world_size: int) -> None:
    """A flag given on the command line that the --ds-config file replaces: said, not silently dropped."""
    from zeroshard.integrations.ds_config import overridden_flags
    from zeroshard.utils.logging import get_logger

    if args.ds_config is None:
        return
    defaults = build_parser().parse_args([])
    given = {f"--{k.replace('_', '-')}" for k, v in vars(args).items() if v != getattr(defaults, k, v)}
    for line in overridden_flags(opts.ds_config, opts.hyper, world_size, given):
        get_logger(__name__).warning(f"zeroshard train: {line}")


def _relaunch(args: argparse.Namespace) -> int:
    from zeroshard.launcher import LaunchOptions, single_node
    from zeroshard.launcher.runner import run_local

    script_args = list(getattr(args, "command_argv", []))
    if getattr(args, "debug", False) and "--debug" not in script_args:
        script_args.append("--debug")
    argv = single_node(
        LaunchOptions("zeroshard.cli.train", script_args, module=True, max_restarts=args.max_restarts),
        args.nproc_per_node,
    )
    code = run_local(argv, args.nproc_per_node)
    if code:
        raise CLIError(
            f"the {args.nproc_per_node} training processes failed (exit code {code}); see their messages above", code
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from zeroshard.cli.main import run_guarded

    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    args.command_argv = raw
    return run_guarded(args.run, args, "zeroshard train")


if __name__ == "__main__":
    sys.exit(main())
