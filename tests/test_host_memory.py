"""``retain_freed_memory``: freed memory is reused without page faults (each case in
its own process: the setting is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A 64 MiB block (above glibc's largest mmap threshold) allocated by malloc, touched
# and freed twice (not NumPy: it asks for huge pages); the minor faults of the second.
CYCLE = """
import ctypes, json, resource, sys
from aristax.host_memory import retain_freed_memory
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def touch_and_free(size=64 << 20):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
touch_and_free()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch_and_free()
print(json.dumps([applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""


def _faults(mode: str) -> tuple:
    out = subprocess.run([sys.executable, "-c", CYCLE, mode], capture_output=True,
                         text=True, check=True).stdout
    return tuple(json.loads(out.splitlines()[-1]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_reused_without_page_faults():
    _, default = _faults("default")
    if default < 4096:  # 64 MiB is 16,384 4-KiB pages; fewer: huge pages, nothing to see
        pytest.skip(f"64 MiB took {default} faults here (transparent huge pages?)")
    applied, retained = _faults("retain")
    assert applied is True
    assert retained < default / 20, (retained, default)
