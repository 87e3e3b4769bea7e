"""The ``aristax`` command: ``aristax train | launch | plan | generate | bench``.

A user error (a bad argument, config key, file or value) prints one line,
``aristax <command>: <what is wrong and how to fix it>``, and exits with status 2; a
failure at run time (a diverged loss, a failed save, a dead peer process) prints one
line and exits with 1; Ctrl-C exits with 130. ``aristax --debug ...`` or
``ARISTAX_DEBUG=1`` shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import re
import subprocess
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import yaml

from aristax.models import cli as models_cli
from aristax.planner import cli as planner_cli
from aristax.train import cli as train_cli

# The benchmark scripts live in the source checkout (an editable install finds them).
BENCHMARKS = Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"
# Errors in what the user gave (arguments, config, files): exit status 2.
USER_ERRORS = (ValueError, OSError, yaml.YAMLError, ImportError)
# Failures while running (a diverged loss, a failed checkpoint save): exit status 1.
RUN_ERRORS = (RuntimeError, FloatingPointError)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the command and ``--help``
    (its subcommands' parsers are of this class too)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {one_line(message)} (see `{self.prog} --help`)\n")


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
        # not a bad input but an install without the source checkout: exit status 1
        raise RuntimeError(f"no benchmark scripts in {BENCHMARKS}; they ship with the "
                           "source: clone aristax and `pip install -e .` there")
    if args.name is None:
        for name, line in found.items():
            print(f"{name:22s} {line}")
        return 0
    if args.name not in found:
        raise ValueError(f"no benchmark named {args.name!r}; choose one of: "
                         f"{', '.join(found)}")
    return subprocess.call([sys.executable, str(BENCHMARKS / f"{args.name}.py"), *args.args])


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="aristax", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (as ARISTAX_DEBUG=1)")
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


def one_line(text: str) -> str:
    """``text`` with its line breaks (and the indentation after them) made spaces."""
    return re.sub(r"\s*\n\s*", " ", text.strip())


def backend_failed(err: AssertionError) -> bool:
    """Whether JAX's backend start-up asserted: what a JAX_PLATFORMS naming a platform
    whose plugin is not installed (``cuda`` on a CPU-only JAX) raises."""
    return any(frame.filename.endswith("xla_bridge.py")
               for frame in traceback.extract_tb(err.__traceback__))


def describe(err: BaseException) -> str:
    """One line saying what went wrong: the message, or for an OS error on a file
    "FILE: reason" (without the errno), or the error's type where it has no message."""
    if isinstance(err, AssertionError):  # backend_failed
        return (f"JAX could not start a backend of JAX_PLATFORMS="
                f"{os.environ.get('JAX_PLATFORMS', '')!r} on this machine: name one its JAX "
                "has (cpu, or cuda with jax[cuda] installed), or unset it")
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    return one_line(str(err)) or type(err).__name__


def exit_status(err: BaseException) -> int:
    """2 for a user error, 130 for Ctrl-C, 1 for a failure at run time."""
    if isinstance(err, KeyboardInterrupt):
        return 130
    return 2 if isinstance(err, (*USER_ERRORS, AssertionError)) else 1


def debugging(flag: bool = False) -> bool:
    """Whether errors show their traceback: the ``--debug`` ``flag`` or ARISTAX_DEBUG
    set (not 0)."""
    return flag or os.environ.get("ARISTAX_DEBUG", "").lower() not in ("", "0", "false")


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default ``sys.argv[1:]``) and return its exit status;
    errors print one line to stderr unless debugging (see the module docstring)."""
    args = build_parser().parse_args(argv)
    undo = (lambda: None) if debugging(args.debug) else silence_background_errors()
    shown = warnings.showwarning
    if not debugging(args.debug):  # a warning as one line too, without its source line
        warnings.showwarning = lambda message, category, *rest: print(
            f"aristax {args.command}: {category.__name__}: {one_line(str(message))}",
            file=sys.stderr)
    try:
        result = args.func(args)
    except (*USER_ERRORS, *RUN_ERRORS, KeyboardInterrupt, AssertionError) as err:
        if debugging(args.debug) or (isinstance(err, AssertionError)
                                     and not backend_failed(err)):
            raise
        print(f"aristax {args.command}: {describe(err)}", file=sys.stderr)
        return exit_status(err)
    finally:
        undo()
        warnings.showwarning = shown
    return result if isinstance(result, int) else 0


def silence_background_errors() -> Callable[[], None]:
    """Until the returned function is called: no log records below CRITICAL from absl
    (orbax), asyncio and tensorboardX, and no tracebacks from background threads or
    unraisable exceptions. After a failed checkpoint save, orbax's and tensorstore's
    threads report the same failure dozens of times, and a diverged run's NaN metrics
    make tensorboardX warn, burying the one line ``main`` prints (``--debug`` shows
    them)."""
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio", "tensorboardX")]
    levels = [logger.level for logger in loggers]
    hooks = sys.unraisablehook, threading.excepthook
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    sys.unraisablehook, threading.excepthook = (lambda unraisable: None), (lambda args: None)

    def undo() -> None:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        sys.unraisablehook, threading.excepthook = hooks

    return undo


def entry() -> None:
    """The ``aristax`` program: ``main``, with background threads kept quiet through
    the interpreter's exit as well (unless debugging), then exit with its status."""
    if not debugging("--debug" in sys.argv[1:2]):
        silence_background_errors()
    sys.exit(main())


if __name__ == "__main__":
    entry()
