"""The README's commands and example stay true."""

from __future__ import annotations

import pathlib
import re

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in README


def test_readme_example_trains(capsys):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
        exec(compile(code, "README.md", "exec"), {})
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_main_job_is_aristax_train_on_a_shipped_config():
    job = re.search(r"```bash\n(.*aristax train (\S+))\n```", README)
    assert job, "the README's first command must run `aristax train CONFIG`"
    assert (ROOT / job.group(2)).is_file()
