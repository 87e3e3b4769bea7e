"""What keeps a run safe from its surroundings: one run per output directory (a lock
held for the run's life), SIGTERM taken as a preemption notice (stop at a step every
process agrees on, after a checkpoint), and enough disk for a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import filelock
import jax
from jax.experimental import multihost_utils

from aristax.train.config import ConfigError

# Set by ``aristax launch`` (to its pid) for its workers: the launcher holds the lock.
LOCK_HOLDER_ENV = "ARISTAX_RUN_LOCK_HOLDER"


class RunLocked(ConfigError):
    """Another run holds the output directory."""


@contextlib.contextmanager
def run_lock(out_dir: Path, *, enabled: bool = True) -> Iterator[None]:
    """Hold ``out_dir/run.lock`` (an OS file lock, released if the process dies) for
    the ``with`` block, writing our pid to ``out_dir/run.pid``; ``RunLocked`` naming
    the holder's pid when another process holds it. Not ``enabled`` (processes other
    than 0), or under ``aristax launch`` (which holds it): nothing."""
    if not enabled or os.environ.get(LOCK_HOLDER_ENV):
        yield
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(out_dir / "run.lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        pid_file = out_dir / "run.pid"
        holder = pid_file.read_text().strip() if pid_file.is_file() else "unknown"
        raise RunLocked(f"out_dir={out_dir} is in use by another run (pid {holder}); give "
                        "this run another name= (or out_dir=), or wait for that one to "
                        "finish") from None
    (out_dir / "run.pid").write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        (out_dir / "run.pid").unlink(missing_ok=True)
        lock.release()


class StopSignals:
    """SIGTERM and SIGINT recorded instead of acted on: ``signum`` is the first one
    received; after it, a Ctrl-C interrupts at once (KeyboardInterrupt). ``restore``
    puts the previous handlers back."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {sig: signal.signal(sig, self._note)
                          for sig in (signal.SIGTERM, signal.SIGINT)}

    def _note(self, signum, frame) -> None:
        del frame
        if self.signum is None:
            self.signum = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C: now

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Preemption:
    """SIGTERM (a preemption notice) or Ctrl-C as a request to stop cleanly.
    ``reached(step)`` is True at the step boundary where the run should save and stop:
    with several processes, JAX's preemption sync point (its notifier catches SIGTERM
    on any process and every process agrees on the step); in one process, after a
    signal ``StopSignals`` recorded. ``close`` restores the previous handlers."""

    def __init__(self):
        self._signals = None if jax.process_count() > 1 else StopSignals()

    @property
    def name(self) -> str:
        """The signal that stopped the run ("SIGTERM" with several processes)."""
        signum = None if self._signals is None else self._signals.signum
        return signal.Signals(signum or signal.SIGTERM).name

    def reached(self, step: int) -> bool:
        if self._signals is None:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._signals.signum is not None

    def close(self) -> None:
        if self._signals is not None:
            self._signals.restore()


def check_free_space(directory: Path, checkpoint_bytes: int) -> None:
    """``ConfigError`` unless the file system of ``directory`` has room for two
    checkpoints of ``checkpoint_bytes`` (orbax writes a new one before it deletes the
    oldest)."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    need = 2 * checkpoint_bytes
    if free < need:
        raise ConfigError(f"out_dir={directory} has {free / 2**20:.1f} MiB free, but a "
                          f"checkpoint takes {checkpoint_bytes / 2**20:.1f} MiB and a save "
                          f"needs room for two ({need / 2**20:.1f} MiB): free space there or "
                          "choose another out_dir=")
