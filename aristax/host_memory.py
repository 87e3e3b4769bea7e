"""Host memory: let malloc keep freed blocks for reuse instead of unmapping them.

XLA:CPU allocates each call's temporaries afresh and frees them at its end. glibc's
malloc serves blocks above its mmap threshold (at most 32 MiB) with ``mmap`` and hands
them back with ``munmap`` when freed, so every call of a jitted step page-faults its
large temporaries in again, the kernel zeroing each page. One forward + backward of the
E 64 layer (``experiments/benchmarks/moe_layer.py`` shapes) took about 69,000 minor
faults (270 MB) that way, against 4,000 with freed memory retained, and 0.80x the time
(E 32: 0.69x, E 8: 0.88x), while a dense MLP's time changed by under 10%, measured side by
side in one process on the project's 2-core VM. ``aristax`` (the command) retains freed
memory; a library user opts in with ``retain_freed_memory()``.
"""

from __future__ import annotations

import ctypes

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Free memory at the top of the heap beyond this goes back to the OS.
RETAINED_BYTES = 1 << 30


def retain_freed_memory() -> bool:
    """Make this process's malloc serve every block from its heap (no ``mmap``) and keep
    up to ``RETAINED_BYTES`` of freed memory at the heap's top (process-wide, for the
    rest of the process; memory freed below the top is reused, not returned).

    Returns True where applied; False where the C library is not glibc (nothing
    changes). The cost: the process's resident memory stays at its high-water mark.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return False
    return libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(
        M_TRIM_THRESHOLD, RETAINED_BYTES) == 1
