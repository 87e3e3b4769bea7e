"""The README's commands and example stay true."""

from __future__ import annotations

import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in README


@pytest.mark.parametrize("block", [0, 2], ids=["one_device", "expert_parallel"])
def test_readme_examples_train(capsys, block):
    """The layer example, and the expert-parallel recipe inside a small language model
    (embedding lookup, integer-label cross-entropy) on this machine's 8 devices."""
    code = re.findall(r"```python\n(.*?)```", README, re.S)[block]
    names = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
        exec(compile(code, "README.md", "exec"), names)
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]
    if block == 2:  # really expert parallel (a user trial: it was a (8, 1) mesh, all
        # 8 experts on every device, plain data parallelism)
        assert dict(names["mesh"].shape) == {"data": 2, "expert": 4}
        up = names["model"].moe.experts.up_edf[...]
        assert up.sharding.shard_shape(up.shape)[0] == 2


def test_readme_sharding_example_splits_experts_over_fsdp_and_f_over_tensor(capsys):
    """The FSDP/tensor example on this machine's 8 devices: each device holds E/4
    experts' halves of F, as its comment says."""
    code = re.findall(r"```python\n(.*?)```", README, re.S)[1]
    assert 'axes=MoEAxes(expert="fsdp", mlp="tensor")' in code
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "(2, 32, 32)"


def test_readme_hf_block_example_equals_the_block(capsys):
    pytest.importorskip("transformers")
    code = re.findall(r"```python\n(.*?)```", README, re.S)[3]
    assert "hf_moe.from_hf(block)" in code
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "True True"


def test_main_job_is_aristax_train_on_a_shipped_config():
    job = re.search(r"```bash\n(.*aristax train (\S+))\n```", README)
    assert job, "the README's first command must run `aristax train CONFIG`"
    assert (ROOT / job.group(2)).is_file()
