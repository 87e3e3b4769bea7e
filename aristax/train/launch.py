"""``aristax launch --local-processes N CONFIG``: N local processes of ``aristax train``.

Each process gets the ARISTAX_* variables ``aristax.parallel.initialize_distributed``
reads (coordinator on a free localhost port, process count and id), CPU devices
(``parallel.devices`` / N each; with ``parallel.devices=0`` each keeps the count
XLA_FLAGS gives, so N of them hold N times as many) and gloo collectives: one machine
behaves like N hosts.
Process 0's output is shown; the others' goes to ``<out_dir>/process_<i>.log``.

If a process exits with an error (or is killed), the launcher stops the others
(SIGTERM, then SIGKILL after ``grace`` seconds) and exits with an error naming the
process and its exit code, so a dead peer never leaves the rest waiting in a
collective; a process that exits 2 (``aristax train``'s config or input error, its
one line in its output) makes the launcher exit 2 too.

SIGTERM or SIGINT to the launcher is forwarded to every process as SIGTERM, which
``aristax train`` takes as a preemption notice (a checkpoint at a step all processes
agree on, then exit); processes still alive ``grace`` seconds later are killed, and
the launcher returns 128 + the signal number. The processes run in their own session
(a terminal's Ctrl-C reaches the launcher only) and die with the launcher if it is
killed outright (Linux parent-death signal). The launcher holds the output
directory's run lock for the run's life.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from aristax.train.run_control import LOCK_HOLDER_ENV, StopSignals, run_lock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
USER_ERROR = 2  # the exit status of `aristax train` on a config or input error


def without_device_count(env: dict[str, str]) -> dict[str, str]:
    """``env`` with XLA_FLAGS' host device count taken out (the train process sets its
    own, ``parallel.devices`` / N); the user's other XLA flags stay."""
    env = dict(env)
    flags = [f for f in env.pop("XLA_FLAGS", "").split()
             if f.split("=", 1)[0] != DEVICE_COUNT_FLAG]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def process_env(process_id: int, num_processes: int, port: int, devices: int
                ) -> dict[str, str]:
    """Process ``process_id``'s environment: the launcher's with the ARISTAX_* variables,
    CPU platform and the run lock's holder; without XLA_FLAGS' device count
    (``without_device_count``) unless ``devices`` (``parallel.devices``) is 0, which
    leaves each process the count it gives."""
    env = without_device_count(os.environ) if devices else dict(os.environ)
    env.update(ARISTAX_COORDINATOR=f"127.0.0.1:{port}",
               ARISTAX_NUM_PROCESSES=str(num_processes), ARISTAX_PROCESS_ID=str(process_id),
               JAX_PLATFORMS="cpu", **{LOCK_HOLDER_ENV: str(os.getpid())})
    return env


def check_processes(num_processes: int, devices: int, grace: float = 10.0) -> None:
    """ValueError unless ``num_processes`` processes can share ``devices`` CPU devices
    (``parallel.devices``; 0: each process keeps its own count) and ``grace`` is a
    number of seconds >= 0."""
    if not 0 <= grace < float("inf"):  # NaN fails too
        raise ValueError(f"--grace={grace} must be a finite number of seconds >= 0 (the "
                         "time the processes have to checkpoint after a SIGTERM)")
    if num_processes < 1:
        raise ValueError(f"--local-processes={num_processes} must be >= 1: give the number "
                         "of processes to start")
    if devices and devices % num_processes:
        raise ValueError(f"parallel.devices={devices} is not divisible by --local-processes="
                         f"{num_processes} (each process gets parallel.devices / N CPU devices): "
                         f"choose a process count that divides {devices} or set parallel.devices "
                         f"to a multiple of {num_processes}")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux prctl
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def launch(config: str, overrides: Sequence[str], num_processes: int, *, out_dir: Path,
           devices: int = 0, grace: float = 10.0, poll: float = 0.2, log=print) -> int:
    """Run ``aristax train config overrides`` in ``num_processes`` local processes
    sharing ``devices`` CPU devices (the config's ``parallel.devices``), holding
    ``out_dir``'s run lock.

    Raises ValueError (see :func:`check_processes`) before starting any process, and
    ``RunLocked`` when another run holds ``out_dir``. Returns 0 when every process
    finished, 128 + the signal number after forwarding a SIGTERM/SIGINT; raises
    RuntimeError naming the first process that failed (after stopping the others).
    """
    check_processes(num_processes, devices, grace)
    with run_lock(out_dir):
        signals = StopSignals()
        try:
            return _run_processes(config, overrides, num_processes, out_dir, devices, grace,
                                  poll, log, signals)
        finally:
            signals.restore()


def _run_processes(config, overrides, num_processes, out_dir, devices, grace, poll, log,
                   signals: StopSignals) -> int:
    """``launch``'s body: start the processes and watch them."""
    port = free_port()
    command = [sys.executable, "-m", "aristax.cli", "train", config, *overrides]
    procs, logs = [], []
    for i in range(num_processes):
        out = None
        if i > 0:
            logs.append((out_dir / f"process_{i}.log").open("w"))
            out = logs[-1]
        procs.append(subprocess.Popen(command, env=process_env(i, num_processes, port, devices),
                                      stdout=out, stderr=subprocess.STDOUT if out else None,
                                      start_new_session=True, preexec_fn=_die_with_parent))
        log(f"launch: process {i} pid {procs[-1].pid}")
    try:
        while True:
            if signals.signum is not None:
                name = signal.Signals(signals.signum).name
                log(f"launch: {name}: asked the {num_processes} processes to checkpoint and "
                    f"stop (SIGTERM; killed after {grace:g} s)")
                stop(procs, grace)
                return 128 + signals.signum
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                stop(procs, grace)
                where = "above" if i == 0 else out_dir / f"process_{i}.log"
                if code == USER_ERROR:  # its one line names the config key or input
                    log(f"launch: process {i} stopped on an error in the config or input "
                        f"(its log: {where}); stopped the other {num_processes - 1}")
                    return USER_ERROR
                raise RuntimeError(
                    f"process {i} (pid {procs[i].pid}) exited with code {code}; stopped the "
                    f"other {num_processes - 1}. Its log: {where}")
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)
    finally:
        stop(procs, grace)
        for f in logs:
            f.close()


def stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process, SIGKILL those still alive after ``grace`` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
