"""The `bitfuse` command: `bitfuse run` (a timed, bit-checked denoising loop) and `bitfuse verify`.

Each subcommand lives in a module exposing `add_arguments(parser)` and
`main(args) -> int`; add one by adding a row to COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (name, module, one-line help)
COMMANDS = [
    ("run", "bitfuse.denoise", "run an LTX-2 denoising loop in each mode, time it, check the latents against eager"),
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
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
