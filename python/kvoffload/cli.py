"""The `kvoffload` command line: `kvoffload simulate` (see `kvoffload.simulate.command`, its
flags in `kvoffload.simulate.flags`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

import kvoffload
from kvoffload._docs import docs_url
from kvoffload.simulate.command import SIMULATE_HELP, RunFailed, run, write_error
from kvoffload.simulate.flags import UsageError, add_arguments


def _usage(prog: str, message: str) -> str:
    return f"{prog}: error: {message}\n(`{prog} --help` lists the flags)\n"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, _usage(self.prog, message))


def _parser() -> _Parser:
    p = _Parser(
        prog="kvoffload",
        description="KV-cache offloading tools.",
        epilog=f"Documentation: {docs_url('index')}",
    )
    p.add_argument("--version", action="version", version=f"kvoffload {kvoffload.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser(
        "simulate",
        help="replay a workload through the scheduler and CPU tier (no GPU)",
        description=SIMULATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(s)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage error (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        return run(args)
    except UsageError as e:
        write_error(_usage("kvoffload simulate", str(e)).rstrip("\n"))
        return 2
    except RunFailed as e:
        write_error(f"kvoffload simulate: {e}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
