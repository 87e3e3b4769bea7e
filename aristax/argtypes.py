"""argparse ``type=`` converters that refuse bad values with the reason.

argparse reports an ``ArgumentTypeError`` as ``argument --flag: <message>`` and exits
with status 2, so a command-line user sees the flag, the value and the fix instead of
a traceback from deep inside the run. Used by the ``aristax`` subcommands and the
benchmark scripts in ``experiments/benchmarks``.
"""

from __future__ import annotations

import argparse


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= {low}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number > 0")
    return value


def _positive_parts(text: str, sep: str, hint: str) -> list[int]:
    parts = text.lower().split(sep)
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give {hint}")
    return [int(p) for p in parts]


def positive_ints(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. ``1,2,4``."""
    return _positive_parts(text, ",", "integers >= 1 separated by commas, e.g. 1,2,4")


def mesh_shape(text: str) -> tuple[int, ...]:
    """Axis sizes joined by ``x``, e.g. ``2x4``: a tuple of integers >= 1."""
    return tuple(_positive_parts(text, "x", "axis sizes >= 1 joined by x, e.g. 2x4"))
