"""DeepSpeed's command-line arguments (`deepspeed.add_config_arguments`), for scripts that call it.

`initialize(args=...)` reads `args.deepspeed_config`, so a script's `--deepspeed_config ds.json` configures
zeroshard as it configured DeepSpeed. `--deepspeed` is a flag for the user's code only, as in DeepSpeed.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to `parser`: `--deepspeed`, `--deepspeed_config` and the deprecated
    `--deepscale`, `--deepscale_config`, with DeepSpeed's defaults (False, None); return the parser.

    Example:
        >>> import argparse, zeroshard
        >>> parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
        >>> args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
        >>> args.deepspeed, args.deepspeed_config
        (True, 'ds.json')
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on the zeroshard engine)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the zeroshard engine)",
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file."
    )
    return parser
