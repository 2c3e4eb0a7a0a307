"""Entry point of the `zeroshard` console script: one subcommand per module, one error policy for all.

Subcommands: validate-config, report, estimate, autotune, launch, accelerate-launch, train (zeroshard.cli), convert
(zeroshard.checkpoint.export).

Errors zeroshard raises on purpose (ConfigError, CLIError, ...) and the usual OS errors are printed
as one line naming the command; `--debug` shows the traceback instead. A bad config exits with 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from zeroshard.cli.common import EXIT_CONFIG, EXIT_FAILURE, CLIError


def build_parser() -> argparse.ArgumentParser:
    from zeroshard import __version__
    from zeroshard.checkpoint import export as convert  # `zeroshard convert` lives with the checkpoint format
    from zeroshard.cli import accelerate_launch, autotune, launch, report, train, validate
    from zeroshard.cli.estimate import command as estimate

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser = argparse.ArgumentParser(
        prog="zeroshard", description="PyTorch-native ZeRO with DeepSpeed's ds_config.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"zeroshard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (validate, report, estimate, autotune, launch, accelerate_launch, train, convert):
        module.add_parser(sub, [common])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from zeroshard.cli.accelerate_launch import split_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    ours, accelerate_args = split_argv(argv)  # accelerate-launch: what follows is accelerate's command line
    args = build_parser().parse_args(ours)
    if accelerate_args is not None:
        args.accelerate_args = accelerate_args
    args.command_argv = argv[argv.index(args.command) + 1 :]  # what a re-launch passes on
    return run_guarded(args.run, args, f"zeroshard {args.command}")


def run_guarded(run: Callable[[argparse.Namespace], int], args: argparse.Namespace, prog: str) -> int:
    """Call `run(args)`; turn expected errors into one line on stderr and an exit code. With several ranks,
    only the rank that failed first reports ([Note: one failure report])."""
    from zeroshard.cli.failures import job_rank

    rank = job_rank()
    if rank is not None:
        prog = f"{prog} [rank {rank}]"
    try:
        return run(args)
    except (Exception, KeyboardInterrupt):
        from zeroshard.checkpoint.decoupled import abandon_all

        try:
            return _report(prog, rank, args)  # first: the rank that failed first claims it before others hear
        finally:
            abandon_all("the command failed before the commit")  # the exit code says it, not an exception at exit


def _bad_input(err: Exception) -> bool:
    """What the user named is wrong (exit 2, as argparse's): a ds_config, a dataset, a hostfile or launch option."""
    from zeroshard.errors import ConfigError
    from zeroshard.integrations.text_data import DataError
    from zeroshard.launcher.hostfile import LaunchError

    return isinstance(err, ConfigError | DataError | LaunchError)


def _report(prog: str, rank: int | None, args: argparse.Namespace) -> int:
    """The line and exit code of the exception being handled."""
    from zeroshard.cli.failures import first_failed_rank, lost_a_peer
    from zeroshard.errors import ZeroshardError

    try:
        raise
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except BrokenPipeError:  # `zeroshard ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:
        if getattr(args, "debug", False):
            raise
        expected = isinstance(err, CLIError | ZeroshardError | OSError | ValueError | ImportError)
        code = err.code if isinstance(err, CLIError) else EXIT_CONFIG if _bad_input(err) else EXIT_FAILURE
        first = first_failed_rank(rank) if rank is not None else None
        if first is not None and first != rank:
            sys.stderr.write(f"{prog}: stopped, see rank {first}'s error\n")
            return code
        peer = lost_a_peer(err)
        if peer is not None:
            sys.stderr.write(
                f"{prog}: error: another rank left the job (the backend says: {peer}); it was killed or "
                "crashed without a report: see the launcher's lines below\n"
            )
            return code
        if not expected:
            raise
        message = str(err) if isinstance(err, CLIError | ZeroshardError) else f"{type(err).__name__}: {err}"
        sys.stderr.write(f"{prog}: error: {message}\n")
        return code


if __name__ == "__main__":
    sys.exit(main())
