"""Run metrics: JSON lines, TensorBoard events, and PNG plots at the end of a run.

Only process 0 writes. ``metrics.jsonl`` holds one JSON object per training step
(step, loss, aux_loss, tokens_per_s, mfu, dropped_fraction, router_entropy,
expert_load [L][E]) and one per evaluation (step, eval_loss), as strict JSON: a NaN
or infinite value (a diverged loss) is written as null.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np


def strict_json(row: dict[str, Any]) -> str:
    """``row`` as one line of strict JSON: non-finite floats (also in lists) as null."""
    def clean(value):
        if isinstance(value, float) and not np.isfinite(value):
            return None
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps({k: clean(v) for k, v in row.items()}, allow_nan=False)


def summary_writer_class() -> type:
    """tensorboardX's ``SummaryWriter``, imported without torch where torch is not yet
    imported. tensorboardX imports torch when it is installed, only to take torch
    tensors (``MetricsWriter`` writes floats); that import took 1.9 s of an
    ``aristax train`` start of 11 s (2-core VM)."""
    masked = "torch" not in sys.modules
    if masked:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if masked:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends to ``out_dir/metrics.jsonl``; a resumed run (``start_step`` > 0) first
    drops the rows (and TensorBoard events) of steps after ``start_step``, which the
    resumed run redoes; a fresh run starts both afresh."""

    def __init__(self, out_dir: Path, *, enabled: bool = True, start_step: int = 0):
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.tb_dir = out_dir / "tensorboard"
        self.rows: list[dict[str, Any]] = []
        self._file = self._tb = None
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                kept = [r for r in read_rows(self.path) if 0 < r["step"] <= start_step]
                self.rows = kept if start_step else []
                self.path.write_text("".join(strict_json(r) + "\n" for r in self.rows))
            self._file = self.path.open("a")
            SummaryWriter = summary_writer_class()
            if not start_step:  # a fresh run: no events of an earlier one
                shutil.rmtree(self.tb_dir, ignore_errors=True)
            # a resumed run: TensorBoard drops the earlier events of the steps it redoes
            self._tb = SummaryWriter(str(self.tb_dir), purge_step=start_step + 1 if start_step else None)

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        self._file.write(strict_json(row) + "\n")
        self._file.flush()
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_run(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """loss.png (training and held-out loss) and expert_load.png (per layer: each
    expert's share of the routed tokens over the steps). Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="training")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                label="held-out")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "loss.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    loads = np.asarray([r["expert_load"] for r in train], np.float64)  # [steps, L, E]
    if loads.ndim == 3 and loads.size:
        shares = loads / np.maximum(loads.sum(axis=-1, keepdims=True), 1)
        L = shares.shape[1]
        fig, axes = plt.subplots(L, 1, figsize=(6, 1.8 * L + 0.6), squeeze=False)
        for layer in range(L):
            ax = axes[layer, 0]
            im = ax.imshow(shares[:, layer].T, aspect="auto", cmap="viridis",  # step s: [s-.5, s+.5]
                           extent=(train[0]["step"] - .5, train[-1]["step"] + .5,
                                   shares.shape[2] - .5, -.5))
            ax.set(ylabel=f"layer {layer}\nexpert")
            fig.colorbar(im, ax=ax, label="share")
        axes[-1, 0].set_xlabel("step")
        fig.suptitle("expert load (share of routed tokens)")
        fig.tight_layout()
        paths.append(out_dir / "expert_load.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
