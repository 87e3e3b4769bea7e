"""The ``aristax`` command: ``aristax train | launch | plan | generate | bench``."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from aristax.models import cli as models_cli
from aristax.planner import cli as planner_cli
from aristax.train import cli as train_cli

# The benchmark scripts live in the source checkout (an editable install finds them).
BENCHMARKS = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"


def benchmarks() -> dict[str, str]:
    """{name: the first line of its docstring} for each script in ``BENCHMARKS`` (none
    where that folder is missing)."""
    found = {}
    for path in sorted(BENCHMARKS.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem] = doc.strip().split("\n", 1)[0]
    return found


def run_bench(args: argparse.Namespace) -> int:
    """Handler of ``aristax bench``: run one benchmark script with its arguments in a
    fresh interpreter (each sets its XLA flags before JAX starts), or list them."""
    found = benchmarks()
    if not found:
        raise SystemExit(f"aristax bench: no benchmark scripts in {BENCHMARKS}; they ship "
                         "with the source: clone aristax and `pip install -e .` there")
    if args.name is None:
        for name, line in found.items():
            print(f"{name:22s} {line}")
        return 0
    if args.name not in found:
        raise SystemExit(f"aristax bench: no benchmark named {args.name!r}; "
                         f"choose one of: {', '.join(found)}")
    return subprocess.call([sys.executable, str(BENCHMARKS / f"{args.name}.py"), *args.args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aristax", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_cli.register(subparsers)
    planner_cli.register(subparsers)
    models_cli.register(subparsers)
    bench = subparsers.add_parser(
        "bench", help="run a benchmark from experiments/benchmarks (no name: list them)",
        description="aristax bench NAME [ARGS...] runs experiments/benchmarks/NAME.py "
                    "ARGS (`aristax bench NAME --help` shows its own options).")
    bench.add_argument("name", nargs="?", help="the script's name without .py")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    bench.set_defaults(func=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
