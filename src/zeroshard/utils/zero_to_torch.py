"""`deepspeed.utils.zero_to_torch`: DeepSpeed's second recovery script, the consolidation of a sharded checkpoint
into whole weights of a chosen dtype (`--dtype` fp32, fp16 or bf16), under DeepSpeed's module path and command line
(the implementation is `zeroshard.checkpoint.export`).

`save_checkpoint` writes a `zero_to_torch.py` beside `latest` that runs `main`, as DeepSpeed 0.19 copies this script
beside `zero_to_fp32.py`: `python ckpt/zero_to_torch.py ckpt out --dtype bf16` works in a checkpoint folder as it does
under DeepSpeed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from zeroshard.checkpoint.export import convert_zero_checkpoint_to_state_dict
from zeroshard.utils.zero_to_fp32 import OUTPUT_DTYPE_NAMES

RECOVERY_SCRIPT = "zero_to_torch.py"
RECOVERY_SOURCE = '''#!/usr/bin/env python
"""Written by zeroshard's save_checkpoint, as DeepSpeed writes its recovery scripts here: `python zero_to_torch.py
CHECKPOINT_DIR OUTPUT_DIR --dtype bf16` consolidates a checkpoint of this folder into whole weights of that dtype
(`-h` for the options; needs zeroshard installed)."""
from zeroshard.utils.zero_to_torch import main

if __name__ == "__main__":
    raise SystemExit(main())
'''


def main(argv: Sequence[str] | None = None) -> int:
    """DeepSpeed's `zero_to_torch.py` command line: `pytorch_model.bin` (sharded past `--max_shard_size`) unless
    `--safe_serialization`, in the `--dtype` asked (required, as DeepSpeed's)."""
    p = argparse.ArgumentParser(prog="zero_to_torch.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("checkpoint_dir", help="the folder save_checkpoint wrote (with `latest`), e.g. path/checkpoint-12")
    p.add_argument("output_dir", help="folder for the state_dict files")
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

    return run_guarded(_convert, args, p.prog)  # an error is one line on stderr (a traceback with -d)


def _convert(args: argparse.Namespace) -> int:
    files = convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        dtype=OUTPUT_DTYPE_NAMES[args.dtype],
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    sys.stdout.write("".join(os.path.join(args.output_dir, f) + "\n" for f in files))
    return 0


__all__ = ["main"]
