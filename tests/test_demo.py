"""`aristax demo` (the README's main job) trains: its loss falls on real local text."""

from __future__ import annotations

import jax
import numpy as np

from aristax import cli


def test_demo_loss_falls(capsys):
    args = cli.build_parser().parse_args(
        ["demo", "--steps", "40", "--batch", "8", "--seq", "32", "--d-model", "32",
         "--log-every", "20", "--max-bytes", "200000"])
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
        result = args.func(args)
    losses = result["losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    assert np.isfinite(result["eval_loss"])
    assert np.asarray(result["expert_load"]).sum() > 0
    assert "held-out loss" in capsys.readouterr().out
