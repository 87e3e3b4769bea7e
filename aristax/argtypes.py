"""argparse ``type=`` converters that refuse bad values with the reason.

argparse reports an ``ArgumentTypeError`` as ``argument --flag: <message>`` and exits
with status 2, so a command-line user sees the flag, the value and the fix instead of
a traceback from deep inside the run. Used by the ``aristax`` subcommands and the
benchmark scripts in ``experiments/benchmarks``.
"""

from __future__ import annotations

import argparse


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number > 0")
    return value


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. ``1,2,4``."""
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give integers >= 1 separated by commas, e.g. 1,2,4")
    return [int(p) for p in parts]


def mesh_shape(text: str) -> tuple[int, ...]:
    """Axis sizes joined by ``x``, e.g. ``2x4``: a tuple of integers >= 1."""
    parts = text.lower().split("x")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give axis sizes >= 1 joined by x, e.g. 2x4")
    return tuple(int(p) for p in parts)
