"""The ``jonebit`` command. Each subcommand lives in its own module and registers itself via ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules with an ``add_parser(subparsers)`` that sets ``func`` (args -> exit code). Add new subcommands here.
SUBCOMMAND_MODULES = (
    "jonebit.doctor",
    "jonebit.launch",
    "jonebit.plot",
    "jonebit.apps.pretrain",
    "jonebit.apps.squad_cli",
    "jonebit.apps.squad",
    "jonebit.train.config_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jonebit", description="Communication-compressed training for JAX.")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jonebit`` console script; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
