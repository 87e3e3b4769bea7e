"""initialize_distributed: environment detection (pure) and a real 2-process run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from aristax import MoEConfig, MoEParams, moe
from aristax.parallel.distributed import first_slurm_host, resolve_distributed


def test_nothing_set_is_single_process():
    assert resolve_distributed({}) is None
    assert resolve_distributed({"ARISTAX_NUM_PROCESSES": "1"}) is None


def test_aristax_env():
    env = {"ARISTAX_COORDINATOR": "h:1234", "ARISTAX_NUM_PROCESSES": "4",
           "ARISTAX_PROCESS_ID": "2", "ARISTAX_LOCAL_DEVICE_IDS": "0,1"}
    assert resolve_distributed(env) == {"coordinator_address": "h:1234", "num_processes": 4,
                                        "process_id": 2, "local_device_ids": [0, 1]}


def test_explicit_wins_then_aristax_then_jax_then_slurm():
    env = {"JAX_COORDINATOR_ADDRESS": "j:1", "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "7",
           "ARISTAX_PROCESS_ID": "5", "SLURM_NTASKS": "16", "SLURM_PROCID": "3",
           "SLURM_STEP_NODELIST": "n[1-4]"}
    got = resolve_distributed(env, process_id=1, local_device_ids=(3,))
    assert got == {"coordinator_address": "j:1", "num_processes": 8, "process_id": 1,
                   "local_device_ids": [3]}
    assert resolve_distributed(env)["process_id"] == 5


def test_slurm():
    env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_JOB_ID": "4242",
           "SLURM_STEP_NODELIST": "gpu[003-005,9],cpu1", "SLURM_JOB_NODELIST": "other"}
    assert resolve_distributed(env) == {"coordinator_address": "gpu003:12242",
                                        "num_processes": 4, "process_id": 3}
    env2 = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "node7",
            "ARISTAX_COORDINATOR_PORT": "999"}
    assert resolve_distributed(env2)["coordinator_address"] == "node7:999"


@pytest.mark.parametrize("nodelist,host", [("a", "a"), ("a[01-02]", "a01"),
                                           ("x-y[7,9-10],z", "x-y7"), ("b1,b2", "b1")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize("env,match", [
    ({"ARISTAX_NUM_PROCESSES": "2"}, "coordinator_address"),
    ({"ARISTAX_COORDINATOR": "h:1", "ARISTAX_NUM_PROCESSES": "2"}, "process_id"),
    ({"ARISTAX_COORDINATOR": "h:1", "ARISTAX_NUM_PROCESSES": "2", "ARISTAX_PROCESS_ID": "2"},
     "process_id=2"),
    ({"ARISTAX_COORDINATOR": "h", "ARISTAX_NUM_PROCESSES": "2", "ARISTAX_PROCESS_ID": "0"},
     "port"),
    ({"ARISTAX_COORDINATOR": "h:1", "ARISTAX_NUM_PROCESSES": "two", "ARISTAX_PROCESS_ID": "0"},
     "num_processes='two'"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "coordinator_address"),
])
def test_partial_or_bad_settings_raise(env, match):
    with pytest.raises(ValueError, match=match):
        resolve_distributed(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process(tmp_path):
    D, F, E, T = 16, 24, 8, 64
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((T, D), np.float32),
            "router": rng.standard_normal((D, E), np.float32) * 0.5,
            "up": rng.standard_normal((E, D, F), np.float32) * D ** -0.5,
            "gate": rng.standard_normal((E, D, F), np.float32) * D ** -0.5,
            "down": rng.standard_normal((E, F, D), np.float32) * F ** -0.5}
    np.savez(tmp_path / "in.npz", **data)
    cfg = MoEConfig(num_experts=E, top_k=2, d_model=D, d_ff=F)
    params = MoEParams(router_de=data["router"], up_edf=data["up"], gate_edf=data["gate"],
                       down_efd=data["down"])
    want = np.asarray(jax.jit(lambda x: moe(x, params, cfg)[0])(data["x"]))

    port = _free_port()
    worker = Path(__file__).with_name("_distributed_worker.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "ARISTAX_"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               ARISTAX_COORDINATOR=f"127.0.0.1:{port}", ARISTAX_NUM_PROCESSES="2")
    procs = [subprocess.Popen(
        [sys.executable, str(worker), str(tmp_path / "in.npz"), str(tmp_path / "out.npy")],
        env=dict(env, ARISTAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [p.communicate()[0][-2000:] for p in procs]
        pytest.fail(f"2-process run did not finish in 240 s; output tails: {tails}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [log[-3000:] for log in logs]
    got = np.load(tmp_path / "out.npy")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
