"""`aristax train`: the loss falls on real local text, what it writes, resume equality,
and restoring onto a different expert-parallel layout (8 CPU devices)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from aristax import cli
from aristax.train import ConfigError, load_config, train
from aristax.train.trainer import (
    build_model, check_batch_split, flops_per_token, lm_loss, lr_schedule, make_steps,
)
from aristax.train.metrics import read_rows

SMALL = ["model.d_model=32", "model.d_ff=64", "model.seq_len=32", "data.batch_size=8",
         "data.max_bytes=300000", "eval_batches=2", "progress=false",
         ]


def run(tmp_path, *overrides, name="run", log=lambda *a: None):
    cfg = load_config("experiments/configs/tiny.yaml",
                      SMALL + [f"out_dir={tmp_path / name}", *overrides])
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
        return train(cfg, log=log)


def test_train_command_loss_falls_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "tiny"
    with jax.numpy_dtype_promotion("standard"):
        code = cli.main(["train", "experiments/configs/tiny.yaml", *SMALL, "steps=40",
                         "eval_every=20", "checkpoint.every=20", "optim.lr=1e-2",
                         f"out_dir={out}"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "mesh {'data': 2, 'expert': 4} from the plan" in printed
    for what in ("checkpoints:", "metrics:", "plots:", "summary:"):
        assert what in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    assert np.isfinite(summary["eval_loss"])
    rows = [r for r in read_rows(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 41))
    load = np.asarray(rows[-1]["expert_load"])  # [L, E]: every token's K picks, per layer
    np.testing.assert_array_equal(load.sum(axis=1), [8 * 32 * 2] * 2)
    assert all(0 < r["router_entropy"] <= np.log(8) + 1e-6 and r["mfu"] > 0 for r in rows)
    assert (out / "loss.png").stat().st_size > 0 and (out / "expert_load.png").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["20", "40"]
    assert any((out / "tensorboard").iterdir())
    assert summary["dropped_fraction"] == np.mean([r["dropped_fraction"] for r in rows]) == 0
    assert summary["unchosen_fraction"] == 0  # token choice routes every token
    assert summary["tokens_per_s"] > 0 and summary["first_step_s"] > 0


@pytest.mark.parametrize("jitter", [0.0, 0.2])
def test_resumed_run_equals_uninterrupted_run(tmp_path, jitter):
    """Also with router jitter, whose RNG key is part of the checkpointed state, and
    with held-out evaluations at other steps: evaluating draws no jitter keys (it drew
    them, so eval_every changed the training losses)."""
    args = ("steps=6", "checkpoint.every=3", f"model.router_jitter={jitter}")
    full = run(tmp_path, *args, "eval_every=1", name="run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")  # as if it died after step 5
    resumed = run(tmp_path, *args, "eval_every=6", "checkpoint.resume=true", name="run")
    assert resumed.summary["first_step"] == 4
    assert resumed.losses == full.losses[3:]  # bit for bit: same data, state and step
    assert resumed.eval_losses[-1] == full.eval_losses[-1]
    # the summary covers the whole run, as metrics.jsonl does (it had steps 4-6 only)
    assert resumed.summary["first_loss"] == full.losses[0]
    assert resumed.summary["final_loss"] == pytest.approx(np.mean(full.losses))
    rows = [r["step"] for r in read_rows(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert rows == list(range(1, 7))


def test_evaluation_runs_without_jitter():
    """With router jitter the held-out loss is the jitter-free model's (the README: off
    when deterministic; evaluation used to run jittered). That it draws no keys is
    checked by the resume test above, which evaluates at other steps."""
    jittered, plain = (build_model(load_config("experiments/configs/tiny.yaml", SMALL + [
        f"model.router_jitter={eps}"]), 256, None, None) for eps in (0.3, 0.0))
    nnx.update(plain, nnx.state(jittered, nnx.Param))
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
    train_loss = [float(lm_loss(m, tokens)[1]["loss"]) for m in (jittered, plain)]
    assert train_loss[0] != train_loss[1]  # jitter is on in training
    _, eval_step = make_steps(bias_update=False)
    evals = [float(eval_step(m, tokens)) for m in (jittered, jittered, plain)]
    np.testing.assert_allclose(evals, [train_loss[1]] * 3, rtol=1e-6)


def test_warm_up_spans_warmup_steps_in_a_shorter_run():
    """The documented ramp: update n at lr * n / warmup_steps while n < warmup_steps,
    whatever ``steps`` is, so a resume with more steps continues it (it used to squeeze
    the ramp into ``steps`` and then restart it on the longer schedule)."""
    cfg = load_config("experiments/configs/tiny.yaml", ["steps=6", "optim.warmup_steps=20"])
    for steps in (6, 9, 400):
        lrs = [float(lr_schedule(dataclasses.replace(cfg, steps=steps))(n)) for n in range(6)]
        np.testing.assert_allclose(lrs, [cfg.optim.lr * n / 20 for n in range(6)], rtol=1e-6)


@pytest.mark.parametrize("overrides", [
    [], ["model.activation=clamped_swiglu"], ["model.activation=gelu", "model.top_k=3"],
    ["model.num_shared_experts=2", "model.shared_d_ff=48", "model.shared_expert_gate=true"]])
def test_flops_per_token_counts_the_weights_a_token_meets(overrides):
    """6 x the model's own parameters that a token multiplies by (the routed experts' at
    K / E; no embedding table or norms) + 12 L D S, counted on the built model. The
    gate of clamped_swiglu and the shared experts were left out before."""
    cfg = load_config("experiments/configs/tiny.yaml", SMALL + overrides)
    m, active = cfg.model, 0.0
    model = nnx.eval_shape(lambda: build_model(cfg, 256, None, None))  # shapes only
    for path, value in jax.tree.leaves_with_path(nnx.state(model, nnx.Param)):
        name = jax.tree_util.keystr(path)
        if "embed" not in name and "norm" not in name:
            active += value.size * (m.top_k / m.num_experts if "['experts']" in name else 1)
    expected = 6 * active + 12 * m.num_layers * m.d_model * m.seq_len
    assert flops_per_token(cfg, 256) == pytest.approx(expected, rel=1e-12)


def test_resume_with_more_steps_logs_the_new_schedule(tmp_path):
    """steps may grow on resume; the cosine schedule then spans the new count, which the
    run says, and every metrics row holds the learning rate it updated with."""
    args = ("checkpoint.every=2", "eval_every=4", "optim.warmup_steps=1")
    first = run(tmp_path, "steps=4", *args)
    assert first.summary["first_step"] == 1
    lines = []
    cfg = load_config("experiments/configs/tiny.yaml", SMALL + [
        f"out_dir={tmp_path / 'run'}", "steps=8", *args, "checkpoint.resume=true"])
    with jax.numpy_dtype_promotion("standard"):
        train(cfg, log=lines.append)
    assert any("resumed with steps=8, the checkpointed run had steps=4" in line
               for line in lines), lines
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    peak, floor = cfg.optim.lr, cfg.optim.lr * cfg.optim.min_lr_ratio

    def cosine(n, steps):  # update n (0-based) after a 1-step warm-up from 0
        return 0.0 if n == 0 else floor + (peak - floor) * 0.5 * (
            1 + np.cos(np.pi * (n - 1) / (steps - 1)))

    expected = [cosine(n, 4) for n in range(4)] + [cosine(n, 8) for n in range(4, 8)]
    assert [r["step"] for r in rows] == list(range(1, 9))
    np.testing.assert_allclose([r["lr"] for r in rows], expected, rtol=1e-5, atol=1e-12)


def test_expert_choice_reports_the_tokens_no_expert_chose(tmp_path):
    """With capacity 0.25 each of the 8 experts takes ceil(0.25 * T * 2 / 8) tokens, so at
    most about half of the T tokens are chosen: the rows and the summary say so (the
    dropped fraction counts capacity drops of token choice only)."""
    lines = []
    result = run(tmp_path, "steps=2", "eval_every=2", "checkpoint.every=2",
                 "model.router=expert_choice", "model.normalize_weights=false",
                 "model.capacity_factor=0.25", "parallel.expert_parallel=false",
                 "parallel.group_size=4", log=lines.append)
    # tiny.yaml's expert_capacity and this group size only shape expert parallelism
    assert ("note: parallel.expert_capacity=2, parallel.group_size=4 shape expert "
            "parallelism, which this run does not use (parallel.expert_parallel=false)"
            in "\n".join(lines))
    rows = [r for r in read_rows(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    tokens = 8 * 32  # data.batch_size x model.seq_len
    chosen_at_most = 8 * int(np.ceil(0.25 * tokens * 2 / 8)) / tokens
    for r in rows:
        assert 1 - chosen_at_most - 1e-6 <= r["unchosen_fraction"] <= 1
    assert result.summary["unchosen_fraction"] == np.mean([r["unchosen_fraction"]
                                                           for r in rows])


def test_a_one_step_run_times_no_steady_step_and_plots_without_warnings(tmp_path):
    """Its only step compiles: no tokens/s is claimed from it; the load plot of one
    step spans it (matplotlib warned of a singular x range)."""
    lines = []
    cfg = load_config("experiments/configs/tiny.yaml", SMALL + [
        f"out_dir={tmp_path / 'run'}", "steps=1", "eval_every=1", "checkpoint.every=1"])
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings():
        warnings.filterwarnings("error", module="matplotlib")
        result = train(cfg, log=lines.append)
    assert result.summary["tokens_per_s"] is None
    assert any("no step after the first to time" in line for line in lines)
    assert (tmp_path / "run" / "expert_load.png").stat().st_size > 0


def test_restore_onto_another_expert_parallel_layout(tmp_path):
    """Checkpoints hold experts in logical order: a run saved on a 2x4 mesh (2 experts
    per device) continues on a 4x2 mesh (4 per device) with the same losses."""
    layout = ("parallel.group_size=2", "parallel.expert_capacity=4")
    args = ("steps=4", "checkpoint.every=2", "eval_every=4")
    full = run(tmp_path, *args, name="run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
    moved = run(tmp_path, *args, "checkpoint.resume=true", *layout, name="run")
    np.testing.assert_allclose(moved.losses, full.losses[2:], rtol=2e-5)


def test_resume_without_checkpoint_says_so(tmp_path):
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        run(tmp_path, "steps=2", "checkpoint.resume=true")


def test_a_run_keeps_to_its_own_checkpoints(tmp_path):
    run(tmp_path, "steps=2", "checkpoint.every=1", "eval_every=2")
    # orbax skipped saving over them: a new run would have left the old checkpoints
    with pytest.raises(ConfigError, match="already holds checkpoints.*checkpoint.resume=true"):
        run(tmp_path, "steps=2", "seed=1")
    with pytest.raises(ConfigError, match="at step 2 and steps=2: nothing to train"):
        run(tmp_path, "steps=2", "checkpoint.resume=true")
    # a resume with another data or model config would read the data position, or
    # the weights, of another run
    for change, key in (("data.seed=7", "data.seed=7 \\(was 0\\)"),
                        ("model.num_layers=1", "model.num_layers=1 \\(was 2\\)")):
        with pytest.raises(ConfigError, match=key):
            run(tmp_path, "steps=4", "checkpoint.resume=true", change)


def test_batch_split_and_divergence_are_errors(tmp_path, capsys, caplog):
    code = cli.main(["train", "experiments/configs/tiny.yaml", "data.batch_size=4",
                     f"out_dir={tmp_path / 'b'}"])
    assert code == 2
    assert ("aristax train: data.batch_size=4 must be a multiple of the 8 devices of the mesh"
            in capsys.readouterr().err)
    cfg = load_config("experiments/configs/tiny.yaml", ["parallel.expert_parallel=false"])
    with pytest.raises(ConfigError, match="2 processes.*parallel.expert_parallel=true"):
        check_batch_split(cfg, None, 2)
    with jax.numpy_dtype_promotion("standard"):
        code = cli.main(["train", "experiments/configs/tiny.yaml", *SMALL, "steps=3",
                         "optim.lr=1e30", "optim.warmup_steps=0", f"out_dir={tmp_path / 'd'}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1, err
    # tensorboardX's warnings of the NaN rows went to stderr beside it (pytest holds them)
    assert not [r for r in caplog.records if r.name.startswith("tensorboardX")], caplog.text
    assert re.match(r"aristax train: step \d: the training loss is nan; lower optim.lr", err[0])


def test_metrics_writer_leaves_torch_unimported_and_importable(tmp_path):
    """tensorboardX imports torch when it is installed (seconds of every run's start);
    the writer keeps it out, and torch still imports afterwards."""
    pytest.importorskip("torch")
    code = f"""
import sys
from pathlib import Path
from aristax.train.metrics import MetricsWriter
w = MetricsWriter(Path({str(tmp_path)!r}))
w.write({{"step": 1, "loss": 2.5}})
w.close()
assert "torch" not in sys.modules, "tensorboardX imported torch"
import torch
print(torch.ones(2).sum().item())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "2.0", proc.stderr[-2000:]
    events = list((tmp_path / "tensorboard").iterdir())
    assert len(events) == 1 and b"loss" in events[0].read_bytes()


def test_the_progress_bar_stops_however_the_loop_ends(monkeypatch):
    """On a terminal, a run stopped by an error or a signal left rich's bar live and
    the cursor hidden (a user trial): the bar stops on any exit of the loop."""
    import io

    from rich.progress import Progress

    from aristax.train.trainer import progress_display

    stops = []
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(Progress, "stop", lambda self: stops.append(self))
    cfg = load_config("experiments/configs/tiny.yaml", ["steps=5"])
    row = {"loss": 1.0, "tokens_per_s": 1.0, "dropped_fraction": 0.0}
    with pytest.raises(KeyboardInterrupt):
        with progress_display(cfg, True, 0) as update:
            update(1, row, print)
            raise KeyboardInterrupt
    assert len(stops) == 1
