"""The ``aristax`` command: ``aristax train | launch | plan | generate``."""

from __future__ import annotations

import argparse
import sys

from aristax.models import cli as models_cli
from aristax.planner import cli as planner_cli
from aristax.train import cli as train_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aristax", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_cli.register(subparsers)
    planner_cli.register(subparsers)
    models_cli.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
