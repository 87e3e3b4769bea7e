"""Small integer helpers for tile sizes, shared by the Triton backends."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def is_pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0
