"""`deepspeed.utils.zero_to_fp32`: consolidate a sharded checkpoint into whole fp32 weights, under DeepSpeed's
module path, function names and command line (the implementation is `zeroshard.checkpoint.export`).

`save_checkpoint` writes a `zero_to_fp32.py` beside `latest` that runs `main`, as DeepSpeed copies its recovery
script there: `python ckpt/zero_to_fp32.py ckpt out` works in a checkpoint folder as it does under DeepSpeed.

Example:
    >>> from zeroshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    >>> model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpt"))  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import re
import sys
from collections.abc import Sequence

import torch

from zeroshard.checkpoint.export import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    to_torch_tensor,
)

# the output dtypes DeepSpeed's conversion names (zero_to_torch.py's --dtype choices)
OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# what save_checkpoint writes beside `latest` (DeepSpeed's `_copy_recovery_script`; zero_to_torch.py too)
RECOVERY_SCRIPT = "zero_to_fp32.py"
RECOVERY_SOURCE = '''#!/usr/bin/env python
"""Written by zeroshard's save_checkpoint, as DeepSpeed writes its recovery script here: `python zero_to_fp32.py
CHECKPOINT_DIR OUTPUT_DIR` consolidates a checkpoint of this folder into whole fp32 weights (`-h` for the options;
needs zeroshard installed)."""
from zeroshard.utils.zero_to_fp32 import main

if __name__ == "__main__":
    raise SystemExit(main())
'''


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """DeepSpeed's: the paths of the optimizer-state files in a checkpoint's tag folder (`ckpt/global_step10`), in
    DeepSpeed's natural order (digit runs compared as numbers). In zeroshard's layout these are
    `optim/rankNNNNN.safetensors`, one per rank that holds optimizer state (stage 0: rank 0 only), and
    `optim/rankNNNNN.partKKKKK.safetensors`, one per rank and optimizer sub-group, where stage 3 kept the state
    on NVMe (docs/checkpoint.md, Format). FileNotFoundError when there are none, as DeepSpeed's.

    Example:
        >>> get_optim_files("ckpt/global_step10")  # doctest: +SKIP
        ['ckpt/global_step10/optim/rank00000.safetensors', 'ckpt/global_step10/optim/rank00001.safetensors']
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    pattern = os.path.join("optim", "rank*.safetensors")
    files = sorted(glob.glob(os.path.join(glob.escape(checkpoint_dir), pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {pattern} files in directory '{checkpoint_dir}'")
    return files


def _natural_key(text: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def main(argv: Sequence[str] | None = None) -> int:
    """DeepSpeed's `zero_to_fp32.py` command line: `pytorch_model.bin` (sharded past `--max_shard_size`) unless
    `--safe_serialization`, as DeepSpeed's script writes."""
    return command_line("zero_to_fp32.py", __doc__, argv)


def command_line(prog: str, description: str | None, argv: Sequence[str] | None, with_dtype: bool = False) -> int:
    """The recovery scripts' command line (zero_to_torch.py's adds a required `--dtype`); an error is one line on
    stderr (a traceback with -d)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("checkpoint_dir", help="the folder save_checkpoint wrote (with `latest`), e.g. path/checkpoint-12")
    p.add_argument("output_dir", help="folder for the state_dict files")
    if with_dtype:
        p.add_argument("--dtype", choices=sorted(OUTPUT_DTYPE_NAMES), required=True, help="the weights' dtype")
    p.add_argument("--max_shard_size", default="5GB", help="largest file before sharding, e.g. 5GB")
    p.add_argument("--safe_serialization", action="store_true", help="safetensors instead of pytorch_model.bin")
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    p.add_argument("-d", "--debug", action="store_true", help="log zeroshard's debug messages; show tracebacks")
    args = p.parse_args(argv)
    if args.debug:
        logging.basicConfig()
        logging.getLogger("zeroshard").setLevel(logging.DEBUG)
    from zeroshard.cli.main import run_guarded

    return run_guarded(_convert, args, p.prog)


def _convert(args: argparse.Namespace) -> int:
    files = convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        dtype=OUTPUT_DTYPE_NAMES[getattr(args, "dtype", None) or "fp32"],
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    sys.stdout.write("".join(os.path.join(args.output_dir, f) + "\n" for f in files))
    return 0


__all__ = [
    "OUTPUT_DTYPE_NAMES",
    "LazyTensor",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "to_torch_tensor",
]

if __name__ == "__main__":
    raise SystemExit(main())
