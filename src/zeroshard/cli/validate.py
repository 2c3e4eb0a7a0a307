"""`zeroshard validate-config FILE [--world-size N]`: parse and resolve a ds_config without training.

Prints the resolved config (keys that differ from DeepSpeed's defaults; `--full` for all) and every
warning the parser gives (deprecated spellings, keys accepted but not implemented yet). "auto" values
that only a training run knows (learning rate, batch sizes, total steps, ...) are filled the way
`zeroshard train` fills them with its defaults, and listed; `--set KEY=VALUE` gives them other values,
`--strict` leaves them unfilled (an error, as plain DeepSpeed would raise). Exit code 2 on any error.

Every rule `initialize` applies to a config alone runs inside `resolve_config`, which both call (the blocks other
modules read, through their own checks: [Note: blocks checked by their readers] in config/blocks.py), and the
world's (`check_world`) on `--world-size`; so a config this command accepts is one `initialize` accepts, but for
what needs the model (the `pipeline` block, MoE layers, a model tensor parallelism can split), the script's process
(autocast's safe module classes) or the process group (tensor/sequence-parallel degrees that divide the world,
taken here as the data-parallel size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from zeroshard.cli.common import EXIT_CONFIG, CLIError, out


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "validate-config",
        parents=parents,
        help="check a ds_config: unknown keys, types, batch math, 'auto' resolution",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("file", help="ds_config JSON file (or a preset name: zero0 ... zero3_offload)")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel world size for the batch math")
    p.add_argument("--hidden-size", type=int, help="the model's hidden size ('auto' bucket sizes)")
    p.add_argument("--model", help="take the hidden size from a model folder or built-in config name")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a value for an 'auto' key, e.g. optimizer.params.lr=1e-4 (JSON values)",
    )
    p.add_argument("--strict", action="store_true", help="do not fill 'auto' with zeroshard train's defaults")
    p.add_argument("--full", action="store_true", help="print every key, defaults included")
    p.add_argument("--json", action="store_true", help="print only the resolved config as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeroshard.config import parse_config, resolve_config
    from zeroshard.config.blocks import check_world
    from zeroshard.errors import ConfigError
    from zeroshard.presets import load_ds_config

    if args.world_size < 1:
        raise CLIError(f"--world-size {args.world_size} must be >= 1", EXIT_CONFIG)
    if args.hidden_size is not None and args.hidden_size < 1:
        raise CLIError(f"--hidden-size {args.hidden_size} must be >= 1", EXIT_CONFIG)
    with _captured_warnings() as warnings:
        raw = load_ds_config(args.file)
        try:
            cfg = parse_config(raw)
            known, filled = _known(args, raw)
            resolved = resolve_config(cfg, world_size=args.world_size, known=known)
            check_world(resolved, args.world_size)
        except ConfigError as err:
            hint = " (--set KEY=VALUE gives it a value)" if '"auto"' in str(err) else ""
            raise ConfigError(f"{args.file}: {err}{hint}") from None
    if args.json:
        out(json.dumps(resolved.to_dict(include_defaults=args.full), indent=2))
        return 0
    z = resolved.zero_optimization
    precision = "fp16" if resolved.fp16.enabled else "bf16" if resolved.bf16.enabled else "fp32"
    out(f"{args.file}: valid for world size {args.world_size}")
    out(
        f"  ZeRO stage {z.stage}, {precision}; train_batch_size {resolved.train_batch_size} = micro batch "
        f"{resolved.train_micro_batch_size_per_gpu} x accumulation {resolved.gradient_accumulation_steps} x "
        f"world size {args.world_size}"
    )
    if filled:
        out("  'auto' filled with zeroshard train's defaults (--set KEY=VALUE to change, --strict to refuse):")
        out("    " + ", ".join(f"{k}={json.dumps(v)}" for k, v in filled.items()))
    if warnings:
        out("warnings:")
        for line in dict.fromkeys(warnings):
            out(f"  {line}")
    out("resolved config" + (":" if args.full else " (keys that differ from DeepSpeed's defaults):"))
    out(json.dumps(resolved.to_dict(include_defaults=args.full), indent=2))
    return 0


def _known(args: argparse.Namespace, raw: dict[str, Any]) -> tuple[dict[str, object], dict[str, object]]:
    """(values for resolve_config, those of them that came from zeroshard train's defaults)."""
    from zeroshard.integrations.ds_config import auto_paths
    from zeroshard.presets.ds_configs import canonical_ds_path, missing_batch_keys

    given: dict[str, object] = {}
    wanted = {canonical_ds_path(path) for path in auto_paths(raw)} | set(missing_batch_keys(raw))
    for item in args.sets:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. optimizer.params.lr=1e-4", EXIT_CONFIG)
        if canonical_ds_path(key) not in wanted:  # (it was dropped without a word: a typo, or a key set in the file)
            autos = ", ".join(sorted(wanted)) or "none"
            raise CLIError(
                f'--set {key}: not an "auto" key of {args.file} (--set fills those: {autos}); edit the file for others',
                EXIT_CONFIG,
            )
        try:
            given[canonical_ds_path(key)] = json.loads(text)
        except json.JSONDecodeError:
            given[canonical_ds_path(key)] = text
    hidden = args.hidden_size or (_hidden_of(args.model) if args.model else None)
    if hidden:
        given["hidden_size"] = hidden
    if args.strict:
        return given, {}
    defaults = _train_defaults(args.world_size)
    filled = {k: v for k, v in defaults.items() if k in wanted and k not in given and k != "hidden_size"}
    needs_hidden = any(p.startswith(("zero_optimization.reduce_", "zero_optimization.stage3_")) for p in wanted)
    if "hidden_size" not in given and needs_hidden:
        filled["hidden_size"] = defaults["hidden_size"]
    return {**filled, **given}, filled


def _train_defaults(world_size: int) -> dict[str, object]:
    from zeroshard.cli.train import build_parser, hyper_from_args
    from zeroshard.presets import MODEL_PRESETS

    args = build_parser().parse_args([])
    known = hyper_from_args(args).known(world_size)
    known["hidden_size"] = MODEL_PRESETS[args.model].hidden_size
    return known


def _hidden_of(model: str) -> int:
    from zeroshard.presets import MODEL_PRESETS, model_preset

    if model in MODEL_PRESETS:
        return model_preset(model).hidden_size
    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as err:
        raise CLIError(f"--model {model}: cannot read {path} ({err})", EXIT_CONFIG) from None
    hidden = data.get("hidden_size") or data.get("n_embd") or data.get("d_model")
    if not isinstance(hidden, int):
        raise CLIError(f"--model {model}: {path} has no hidden_size; pass --hidden-size", EXIT_CONFIG)
    return hidden


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[str]):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage().removeprefix("zeroshard: "))


@contextlib.contextmanager
def _captured_warnings() -> Iterator[list[str]]:
    """Collect the config parser's warnings to print them in the report instead of as log lines."""
    from zeroshard.utils.logging import get_logger

    logger = get_logger("zeroshard.config")
    sink: list[str] = []
    handler = _ListHandler(sink)
    previous = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield sink
    finally:
        logger.removeHandler(handler)
        logger.propagate = previous
