"""Checkpoints with orbax-checkpoint: model and optimizer state, data position, step.

Each checkpoint (``<out_dir>/checkpoints/<step>/``) holds
  * "state": the model's and the optimizer's state as one pure dict of host arrays,
    with expert weights (and their optimizer moments) in *logical* expert order, so
    a run restores onto any mesh or expert-parallel layout;
  * "data": the grain iterator state of the training stream;
  * "meta": the step and the config it was written with.
PRNG key arrays are stored as their raw key data and re-wrapped on restore.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from aristax.parallel import layout_expert_weights

EXPERT_WEIGHTS = ("gate_edf", "up_edf", "down_efd")


def _key(entry):
    return getattr(entry, "key", getattr(entry, "idx", None))


def _is_expert_weight(path) -> bool:
    keys = [_key(k) for k in path]
    return "experts" in keys and keys[-1] in EXPERT_WEIGHTS


def _move_experts(tree, perm: Sequence[int] | None, *, inverse: bool):
    """Expert weights (any leaf at .../experts/<gate_edf|up_edf|down_efd>) between the
    physical slot order ``perm`` and the logical order (``inverse``: to logical), and
    the layers' ``expert_layout`` with them (the identity in logical order)."""
    if perm is None:
        return tree

    def move(path, leaf):
        if _key(path[-1]) == "expert_layout":  # MoE.expert_layout: logical is the identity
            return np.arange(max(perm) + 1, dtype=np.int32) if inverse else \
                np.asarray(perm, np.int32)
        return layout_expert_weights(leaf, perm, inverse=inverse) if _is_expert_weight(path) \
            else leaf

    return jax.tree_util.tree_map_with_path(move, tree)


def _to_host(leaf):
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        leaf = multihost_utils.process_allgather(leaf, tiled=True)
    return np.asarray(leaf)


def _from_host(saved, template):
    if isinstance(template, jax.Array) and jax.dtypes.issubdtype(template.dtype,
                                                                  jax.dtypes.prng_key):
        return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(template))
    return saved


class Checkpointer:
    """Periodic and final checkpoints of a training run under ``directory``."""

    def __init__(self, directory: str | Path, *, keep: int, expert_perm=None):
        self.expert_perm = expert_perm
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "data", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_state: dict, meta: dict) -> None:
        """``state``: a pure dict of arrays (model and optimizer, physical order)."""
        host = jax.tree.map(_to_host, _move_experts(state, self.expert_perm, inverse=True))
        saved = self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(host), data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(dict(meta, step=step))))
        if not saved:  # orbax skips a step at or before the latest one it holds
            raise RuntimeError(f"checkpoint of step {step} not written: "
                               f"{self.manager.directory} already holds step "
                               f"{self.manager.latest_step()}")

    def meta(self, step: int) -> dict:
        """The "meta" item of ``step`` (its step and the config it was written with)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, template: dict, place: Callable[[Any, Any], Any],
                step: int | None = None) -> tuple[dict, dict, dict]:
        """(state laid out like ``template`` and placed by ``place(saved, template_leaf)``,
        data state, meta) of ``step`` (default: the latest)."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}: run without "
                                    "checkpoint.resume=true first")
        target = jax.tree.map(_to_host, _move_experts(template, self.expert_perm, inverse=True))
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        mismatched = [(jax.tree_util.keystr(path), np.shape(a), np.shape(b)) for (path, a), b
                      in zip(jax.tree_util.tree_leaves_with_path(out["state"]),
                             jax.tree.leaves(target)) if np.shape(a) != np.shape(b)]
        if mismatched:
            name, found, expected = mismatched[0]
            raise ValueError(f"checkpoint step {step}: {name} has shape {found}, the model "
                             f"expects {expected} ({len(mismatched)} tensors differ); resume "
                             "with the model config the run was written with")
        saved = _move_experts(out["state"], self.expert_perm, inverse=False)
        state = jax.tree.map(lambda s, t: place(_from_host(s, t), t), saved, template)
        return state, out["data"], out["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
