"""Issue 32: a bad input to the ``aristax`` command prints ONE line on stderr, naming
the input and the fix, and exits with 2 (1 for a failure at run time, 130 for Ctrl-C);
``aristax --debug ...`` or ``ARISTAX_DEBUG=1`` shows the traceback instead.

Each case runs ``python -m aristax`` in a fresh process (about 2 s each) on an input
that fails before any model compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from aristax import cli
from aristax.models.mixtral_config import MixtralConfig
from aristax.planner import cli as planner_cli

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "experiments" / "configs" / "tiny.yaml")


def aristax(*argv: str, debug_env: bool = False, platforms: str = "cpu"
            ) -> subprocess.CompletedProcess:
    """``python -m aristax ARGV`` on the CPU (JAX_PLATFORMS), from the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "ARISTAX_DEBUG"}
    env["JAX_PLATFORMS"] = platforms
    if debug_env:
        env["ARISTAX_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", "aristax", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def one_line_error(run: subprocess.CompletedProcess, command: str, code: int = 2) -> str:
    """The single stderr line of a run that failed with ``code``."""
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert run.returncode == code, (run.returncode, run.stderr)
    assert lines[0].startswith(f"aristax {command}: "), lines[0]
    return lines[0]


def checkpoint(path: Path, tensors: dict | None = None) -> Path:
    """A Hugging Face Mixtral directory with a tiny config.json and ``tensors`` in
    model.safetensors (the loader reads the file before any weight is built)."""
    path.mkdir()
    config = MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           num_local_experts=2)
    (path / "config.json").write_text(json.dumps(config.to_hf()))
    save_file(tensors or {"model.embed_tokens.weight": np.zeros((32, 8), np.float32)},
              str(path / "model.safetensors"))
    return path


# ----------------------------------------------------------------------- plan
@pytest.mark.parametrize("spec, said", [
    ("perlmuter:4", "did you mean perlmutter?"),  # a typo: the name it meant
    ("perlmutter:1,2", "too many positional arguments; its parameters are nodes=4"),  # was a TypeError
    # 400,000 devices: 149 GiB allocated before; now refused before any allocation
    ("perlmutter:100000", "more than the planner's limit of 4096"),
])
def test_plan_bad_presets(spec, said):
    line = one_line_error(aristax("plan", spec), "plan")
    assert spec in line and said in line, line


def test_plan_topology_file_errors_name_the_file_and_line(tmp_path):
    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("preset: [perlmutter\nnodes: 4\n")
    line = one_line_error(aristax("plan", str(syntax)), "plan")
    assert str(syntax) in line and "invalid YAML at line 2" in line, line
    keyword = tmp_path / "keyword.yaml"  # was a TypeError
    keyword.write_text("preset: perlmutter\nnodez: 4\n")
    line = one_line_error(aristax("plan", str(keyword)), "plan")
    assert str(keyword) in line and "'nodez'" in line and "nodes=4" in line, line


def test_argument_errors_are_one_line():
    line = one_line_error(aristax("plan", "perlmutter:1", "--experts", "x"), "plan")
    assert "--experts" in line and "aristax plan --help" in line, line


def test_a_missing_config_file_is_named_once(tmp_path):
    """A user trial: "PATH: [Errno 2] No such file or directory: 'PATH'" (the errno and
    the path twice), against cli.describe's "FILE: reason"."""
    missing = tmp_path / "none.yaml"
    line = one_line_error(aristax("train", str(missing)), "train")
    assert line == f"aristax train: {missing}: No such file or directory", line


# ------------------------------------------------------------------- generate
def test_generate_truncated_weight_file(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    line = one_line_error(aristax("generate", str(ckpt), "--ids", "1"), "generate")
    assert str(weights) in line and "not a readable .safetensors file" in line, line
    assert "download or save the checkpoint again" in line


def test_generate_missing_weight_file_and_tensor(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")  # holds the embedding only
    line = one_line_error(aristax("generate", str(ckpt), "--ids", "1"), "generate")
    assert "missing tensor 'model.norm.weight'" in line and "(model.safetensors)" in line, line
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    shard = ckpt / "model-00002-of-00002.safetensors"  # listed in the index, not there
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": shard.name}}))
    line = one_line_error(aristax("generate", str(ckpt), "--ids", "1"), "generate")
    assert f"weight file {shard} is missing" in line, line


def test_generate_config_that_is_not_an_object(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").write_text("[1, 2]")  # was an AttributeError
    line = one_line_error(aristax("generate", str(ckpt), "--ids", "1"), "generate")
    assert str(ckpt / "config.json") in line and "not an object" in line, line


# ---------------------------------------------------------------------- train
def test_train_source_that_is_not_a_npy_file(tmp_path):
    fake = tmp_path / "tokens.npy"
    fake.write_text("hello world\n")  # numpy's own error talks about allow_pickle
    run = aristax("train", TINY, f"data.source={fake}", f"out_dir={tmp_path / 'run'}")
    line = one_line_error(run, "train")
    assert str(fake) in line and "is not a NumPy .npy array file" in line, line


def test_a_jax_platform_not_installed_is_one_line(tmp_path):
    """JAX_PLATFORMS=cuda on a JAX without its plugin: JAX asserts while starting the
    backend, which printed a 28-line traceback (a user trial)."""
    import importlib.util

    if importlib.util.find_spec("jax_plugins") is not None:
        pytest.skip("a JAX plugin is installed: cuda may start here")
    run = aristax("train", TINY, "steps=1", f"out_dir={tmp_path / 'run'}", platforms="cuda")
    line = one_line_error(run, "train")
    assert "JAX_PLATFORMS='cuda'" in line and "unset it" in line, line


# ------------------------------------------------------------------ debugging
@pytest.mark.parametrize("flag, debug_env", [(["--debug"], False), ([], True)])
def test_debug_shows_the_traceback(flag, debug_env):
    run = aristax(*flag, "plan", "perlmuter:4", debug_env=debug_env)
    assert run.returncode == 1  # the uncaught exception's status
    assert "Traceback (most recent call last)" in run.stderr
    assert "ValueError: TOPOLOGY 'perlmuter:4'" in run.stderr


# ----------------------------------------------- run-time failures, in-process
@pytest.mark.parametrize("error, code", [(RuntimeError("checkpoint save failed\nat step 3"), 1),
                                         (FloatingPointError("the loss is nan"), 1),
                                         (KeyboardInterrupt(), 130)])
def test_run_time_failures_are_one_line(monkeypatch, capsys, error, code):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.delenv("ARISTAX_DEBUG", raising=False)
    monkeypatch.setattr(planner_cli, "make_plan", fail)
    try:
        assert cli.main(["plan", "perlmutter:1"]) == code
    except KeyboardInterrupt:  # not caught: would stop pytest itself
        pytest.fail("aristax.cli.main let KeyboardInterrupt through")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("aristax plan: "), err
    assert err.strip() == f"aristax plan: {' '.join(str(error).split()) or 'interrupted'}"


def test_a_warning_is_one_line_too(monkeypatch, capsys):
    """A library warning during a command (e.g. generation_config.json settings not
    applied) printed Python's two lines with its source line (a user trial)."""
    import warnings

    def warn_then_fail(*args, **kwargs):
        warnings.warn("a setting\nnot applied", UserWarning)
        raise ValueError("stop here")

    monkeypatch.delenv("ARISTAX_DEBUG", raising=False)
    monkeypatch.setattr(planner_cli, "make_plan", warn_then_fail)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.main(["plan", "perlmutter:1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "aristax plan: UserWarning: a setting not applied", "aristax plan: stop here"]
