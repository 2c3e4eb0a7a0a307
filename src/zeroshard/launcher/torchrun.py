"""`python -m zeroshard.launcher.torchrun ARGS`: torch.distributed.run with the same arguments, quieter failures.

torchrun ends a failed job with a Python traceback of its own ChildFailedError and a table of the
failed ranks. The workers have already printed their one-line errors, so this wrapper replaces the
traceback with one line per failed rank and exits with the first failure's exit code (so a
configuration error in the workers still exits with 2).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as err:
        first_rank, first = err.get_first_failure()
        for rank, failure in sorted(err.failures.items()):
            sys.stderr.write(
                f"zeroshard launch: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
                f"exited with {failure.exitcode}\n"
            )
        code = first.exitcode
        return code if 0 < code < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
