"""`deepspeed.utils.zero_to_torch`: DeepSpeed's second recovery script, the consolidation of a sharded checkpoint
into whole weights of a chosen dtype (`--dtype` fp32, fp16 or bf16), under DeepSpeed's module path and command line
(the implementation is `zeroshard.checkpoint.export`).

`save_checkpoint` writes a `zero_to_torch.py` beside `latest` that runs `main`, as DeepSpeed 0.19 copies this script
beside `zero_to_fp32.py`: `python ckpt/zero_to_torch.py ckpt out --dtype bf16` works in a checkpoint folder as it does
under DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Sequence

from zeroshard.utils.zero_to_fp32 import command_line

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
    return command_line("zero_to_torch.py", __doc__.split("\n\n")[0] if __doc__ else None, argv, with_dtype=True)


__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
