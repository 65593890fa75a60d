"""The `bitfuse` command: `bitfuse run` (the LTX-2 pipeline in each mode, timed and
checked bit for bit) and `bitfuse verify`.

Each subcommand lives in a module exposing `add_arguments(parser)` and
`main(args) -> int`; add one by adding a row to COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (name, module, one-line help)
COMMANDS = [
    ("run", "bitfuse.run", "run the LTX-2 pipeline in each mode, time it, check its video and audio bit for bit"),
    ("verify", "bitfuse.verify", "check which fast paths are active here and that they agree with eager"),
]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="bitfuse", description="Faster diffusion-transformer inference, bit for bit.")
    parser.add_argument("--version", action="version", version=f"bitfuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_ in COMMANDS:
        p = sub.add_parser(name, help=help_, description=help_)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point (`bitfuse = bitfuse.cli:main`); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help, --version or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if getattr(args, "_main", None) is None:
        parser.print_help(sys.stderr)
        return 2
    problem = _environment_problem()
    if problem:
        print(f"bitfuse: error: {problem}", file=sys.stderr)
        return 2
    return int(args._main(args) or 0)


def _environment_problem() -> str | None:
    """A BITFUSE_VERIFY that bitfuse.policy does not know: a one-line error here, rather
    than a traceback or a warning that the run goes on without the checks it asked for."""
    verify = os.environ.get("BITFUSE_VERIFY", "")
    if verify.strip().lower() not in ("", "once", "always"):
        return f"BITFUSE_VERIFY={verify!r}: use 'once' (the default) or 'always'"
    return None


if __name__ == "__main__":
    sys.exit(main())
