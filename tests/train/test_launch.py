"""`aristax launch --local-processes 2`: two processes (4 CPU devices each, gloo) train
together and agree; a process that dies stops the other within a bounded time; bad
process counts are CLI errors before any process starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from aristax import cli
from aristax.train import launch

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.d_model=32", "model.d_ff=64", "model.seq_len=32", "data.batch_size=8",
         "data.max_bytes=300000", "eval_batches=1", "progress=false"]


def launcher(tmp_path, *overrides, processes: int = 2):
    env = launch.without_device_count(os.environ)  # conftest's 8 devices out, its other flags in
    cmd = [sys.executable, "-m", "aristax.cli", "launch", "--local-processes", str(processes),
           "--grace", "5", "experiments/configs/tiny.yaml", *SMALL,
           f"out_dir={tmp_path / 'run'}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def losses_of(text: str, process: int) -> list[float]:
    match = re.search(rf"process {process} losses (\[.*\])", text)
    assert match, text[-2000:]
    return json.loads(match.group(1))


def test_four_processes_train_together_agree_and_checkpoint(tmp_path):
    """Four processes of 2 devices: each expert-parallel group of the (2, 4) mesh spans
    two processes. A user trial found the checkpoint save hanging there (an eager
    gather of the expert weights across processes, interleaved with the host
    gathers); two processes, one group each, did not show it. Two checkpoints are
    saved (the second waits for the first to be read back)."""
    proc = launcher(tmp_path, "steps=2", "eval_every=2", "checkpoint.every=1", processes=4)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "8 devices in 4 process(es)" in out
    log3 = (tmp_path / "run" / "process_3.log").read_text()
    first, last = losses_of(out, 0), losses_of(log3, 3)
    assert len(first) == 2 and first == last
    assert {p.name for p in (tmp_path / "run" / "checkpoints").iterdir()} >= {"1", "2"}


def test_a_dead_process_stops_the_others(tmp_path):
    proc = launcher(tmp_path, "steps=100000", "eval_every=100000", "checkpoint.every=100000")
    pid = None
    for line in proc.stdout:  # "launch: process 1 pid N", then process 0's output
        if m := re.match(r"launch: process 1 pid (\d+)", line):
            pid = int(m.group(1))
        if pid and line.startswith("aristax train"):  # both have started training
            break
    assert pid is not None
    time.sleep(2)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == 1
    assert f"process 1 (pid {pid}) exited with code -9" in err


def test_a_config_error_in_the_processes_exits_2(tmp_path):
    """A batch of 8 rows does not split over 16 devices: each process prints the one-line
    config error and exits 2, and so does the launcher (it exited 1, as on a crash)."""
    proc = launcher(tmp_path, "parallel.devices=16")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err[-2000:]
    assert "data.batch_size=8" in err and "Traceback" not in err + out
    assert "launch: process" in out + err and "error in the config or input" in out + err


def test_bad_process_counts_are_cli_errors_before_any_process_starts(tmp_path, monkeypatch,
                                                                     capsys):
    def no_process(*args, **kwargs):
        raise AssertionError("a process started")

    monkeypatch.setattr(launch.subprocess, "Popen", no_process)
    config = str(ROOT / "experiments" / "configs" / "tiny.yaml")
    cases = {("0", "parallel.devices=8"): "--local-processes=0 must be >= 1",
             ("3", "parallel.devices=8"): "parallel.devices=8 is not divisible by "
                                          "--local-processes=3",
             # a SIGTERM then killed the processes at once, before any checkpoint
             ("2", "--grace=-1"): "--grace=-1.0 must be a finite number of seconds >= 0",
             ("2", "--grace=nan"): "--grace=nan must be"}
    for (n, option), message in cases.items():
        devices = option if option.startswith("parallel") else "parallel.devices=8"
        grace = [option] if option.startswith("--grace") else []
        argv = ["launch", "--local-processes", n, *grace, config, devices,
                f"out_dir={tmp_path / 'run'}"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("aristax launch: ") and message in err
    assert not (tmp_path / "run").exists()
    # parallel.devices=0 leaves each process its own device count: any N is fine
    launch.check_processes(3, 0)
    with pytest.raises(ValueError, match="parallel.devices=8 is not divisible"):
        launch.launch(config, [], 3, out_dir=tmp_path / "run", devices=8)


@pytest.mark.parametrize("flags,kept", [
    ("--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math",
     "--xla_dump_to=/tmp/d --xla_cpu_enable_fast_math"),
    ("--xla_force_host_platform_device_count=8", None),
    (None, None)])
def test_processes_keep_the_users_xla_flags_but_not_the_device_count(monkeypatch, flags, kept):
    """Each process sets its own device count (parallel.devices / N); the user's other
    XLA flags (a dump, a backend option) reach it unchanged."""
    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    env = launch.process_env(1, 2, 1234, devices=8)
    assert env.get("XLA_FLAGS") == kept
    assert env["ARISTAX_PROCESS_ID"] == "1" and env["ARISTAX_NUM_PROCESSES"] == "2"
    # parallel.devices=0 leaves each process the count XLA_FLAGS gives (it was dropped)
    assert launch.process_env(1, 2, 1234, devices=0).get("XLA_FLAGS") == flags


def test_a_missing_plan_under_several_processes_does_not_suggest_one_process(monkeypatch):
    """Without a plan one process may run without expert parallelism; several processes
    may not (``check_batch_split``), so the message does not send them there."""
    from aristax.train import load_config
    from aristax.train.parallel_setup import plan_and_mesh

    cfg = load_config("experiments/configs/tiny.yaml", ["parallel.expert_capacity=1"])
    with pytest.raises(ValueError, match=r"no expert-parallel plan .*\(set parallel.expert_"
                                         r"parallel=false to run without one\)"):
        plan_and_mesh(cfg, jax.devices()[:4])  # 4 devices x 1 expert < 8 experts
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"\(2 processes train only through one: change the "
                                         r"settings above or the number of devices\)") as err:
        plan_and_mesh(cfg, jax.devices()[:4])
    assert "expert_parallel=false" not in str(err.value)


def test_parallel_devices_that_a_started_backend_cannot_have_is_refused(monkeypatch):
    """In a process whose CPU backend already runs 8 devices (conftest), another count
    cannot take effect: refused, naming the values that work."""
    from aristax.train import load_config
    from aristax.train.parallel_setup import start_processes

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after

    cfg = load_config("experiments/configs/tiny.yaml", ["parallel.devices=2"])
    with pytest.raises(ValueError, match=r"parallel.devices=2 needs 2 CPU devices.*JAX "
                                         r"started with 8.*parallel.devices=8"):
        start_processes(cfg)
