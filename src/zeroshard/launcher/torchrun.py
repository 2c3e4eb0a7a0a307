"""`python -m zeroshard.launcher.torchrun ARGS`: torch.distributed.run with the same arguments, quieter failures.

torchrun ends a failed job with an error log line per failed worker, a Python traceback of its own
ChildFailedError and a table of the failed ranks. The workers have already printed their error (once:
[Note: one failure report]), so this wrapper replaces all of that with one line naming the rank that
failed first and exits with its exit code (so a configuration error in the workers still exits with 2).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from zeroshard.launcher.plan import STOP_WHEN_INPUT_CLOSES


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if os.environ.pop(STOP_WHEN_INPUT_CLOSES, "") == "1":  # (popped: not the workers')
        threading.Thread(target=_stop_when_input_closes, name="zeroshard-input-watch", daemon=True).start()
    # its "failed (exitcode: 1) local_rank: 0 ..." lines say what the one line below says
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        first_rank, first = err.get_first_failure()
        others = sorted(r for r in err.failures if r != first_rank)
        also = f"; rank(s) {others} stopped too" if others else ""
        sys.stderr.write(
            f"zeroshard launch: rank {first_rank} (local rank {first.local_rank}, pid {first.pid}) failed first, "
            f"{_how(first.exitcode)}{also}{_hint(args, first.exitcode)}\n"
        )
        code = first.exitcode
        return code if 0 < code < 256 else 1
    except SignalException as err:  # stopped: its workers were told and have said so ([Note: stopping a local run])
        return 128 + int(err.sigval)
    return 0


def _stop_when_input_closes() -> None:
    """[Note: stopping remote nodes]: read (and drop) this process's input until it closes, then SIGTERM this
    process: torchrun stops its workers as for any SIGTERM."""
    with contextlib.suppress(OSError):
        while os.read(0, 1 << 16):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def _hint(args: argparse.Namespace, exitcode: int) -> str:
    """Exit code 2 is argparse's: a script that does not take the --local_rank=N given to it says so above."""
    given = args.training_script == "/bin/sh" and "--local_rank=" in " ".join(args.training_script_args[:2])
    if exitcode != 2 or not given:  # [Note: the --local_rank argument]
        return ""
    return (
        " (every script was given --local_rank=N, as DeepSpeed's launcher gives it; if the script does not take it, "
        "pass --no_local_rank to zeroshard launch)"
    )


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


if __name__ == "__main__":
    sys.exit(main())
