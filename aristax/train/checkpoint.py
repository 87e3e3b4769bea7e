"""Checkpoints with orbax-checkpoint: model and optimizer state, data position, step.

Each checkpoint (``<out_dir>/checkpoints/<step>/``) holds
  * "state": the model's and the optimizer's state as one pure dict of host arrays,
    with expert weights (and their optimizer moments) in *logical* expert order, so
    a run restores onto any mesh or expert-parallel layout;
  * "data": the grain iterator state of the training stream;
  * "meta": the step, the config it was written with, the training data's fingerprint,
    and a checksum (BLAKE2b) of every saved array and of the data state.
PRNG key arrays are stored as their raw key data and re-wrapped on restore.

Integrity: every checkpoint is read back and checked against its checksums once
orbax has written it (``poll`` at each step, ``wait`` at the end); a restore checks
them again. A mismatch, a missing or unreadable file raises ``CorruptCheckpoint``
naming the tensor and the step and how to resume from an earlier intact one
(``checkpoint.step=``). A save that fails in orbax's background thread (a full disk)
raises ``CheckpointSaveError`` at the next ``poll``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from aristax.parallel import layout_expert_weights
from aristax.sharding import EXPERT_FIELDS as EXPERT_WEIGHTS  # MoE.experts' attribute names


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files are missing, unreadable or differ from their checksums."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (e.g. the disk is full)."""


def _one_line(err: Exception) -> str:
    """An exception's message on one line (its type when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


def _os_error(message: str) -> str | None:
    """The OS error named in a failed write's ``message`` ("File too large [Errno 27]"),
    from Python's "[Errno N]" or TensorStore's "os_error_code='N'" (which ends a message
    hundreds of characters long, its readable reason far before it), else None."""
    found = re.search(r"\[Errno (\d+)\]|os_error_code='?(\d+)", message)
    if found is None:
        return None
    code = int(found.group(1) or found.group(2))
    return f"{os.strerror(code)} [Errno {code}]"


def checksum(array: np.ndarray) -> str:
    """BLAKE2b (16 bytes, hex) of an array's dtype, shape and bytes."""
    array = np.ascontiguousarray(array)
    digest = hashlib.blake2b(f"{array.dtype.str}{array.shape}".encode(), digest_size=16)
    digest.update(array.tobytes())
    return digest.hexdigest()


def tensor_name(path) -> str:
    """A tree path as the dotted name orbax and tensorstore use ("model.embed_vd")."""
    return ".".join(str(_key(entry)) for entry in path)


def tree_checksums(tree) -> dict[str, str]:
    """{``tensor_name``: ``checksum``} of every array leaf of ``tree`` (host arrays)."""
    return {tensor_name(path): checksum(np.asarray(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def json_checksum(value) -> str:
    """BLAKE2b of a JSON value (sorted keys): the data iterator state's checksum."""
    text = json.dumps(value, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _key(entry):
    return getattr(entry, "key", getattr(entry, "idx", None))


def _is_expert_weight(path) -> bool:
    keys = [_key(k) for k in path]
    return "experts" in keys and keys[-1] in EXPERT_WEIGHTS


def _move_experts(tree, perm: Sequence[int] | None, *, inverse: bool):
    """Expert weights (any leaf at .../experts/<one of EXPERT_WEIGHTS>) between the
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


def _check_logical_layouts(saved, step: int) -> None:
    """Refuse a checkpoint whose MoE layers' ``expert_layout`` is not the identity:
    ``save`` writes every layer in logical expert order, so another layout means
    weights in another order (a checkpoint written by other code), which restoring as
    logical would silently mismatch with their experts."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(saved):
        if _key(path[-1]) == "expert_layout" and not np.array_equal(
                leaf, np.arange(np.size(leaf))):
            raise ValueError(
                f"checkpoint step {step}: {tensor_name(path)} is "
                f"{np.asarray(leaf).tolist()}, not the logical expert order "
                f"{list(range(np.size(leaf)))} that aristax train writes: its expert weights "
                "are stored in another order. Resave them in logical order "
                "(MoE.logical_params() of the layer that wrote them) and resume from that")


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
    """Periodic and final checkpoints of a training run under ``directory``, each
    verified once written (``poll``/``wait``) and again on ``restore``."""

    def __init__(self, directory: str | Path, *, keep: int, expert_perm=None):
        self.expert_perm = expert_perm
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "data", "meta"))
        self._pending: tuple[int, Any] | None = None  # (step, host tree) not yet read back

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, data_state: dict, meta: dict) -> None:
        """``state``: a pure dict of arrays (model and optimizer, physical order);
        written by orbax in the background, with the checksums in its meta."""
        self.poll(wait=True)  # the previous save: finished and read back
        # gathered to the host first, then reordered there: an eager gather of a
        # weight sharded over several processes, interleaved with process_allgather,
        # hung a 4-process launch (each process waiting in another collective)
        host = _move_experts(jax.tree.map(_to_host, state), self.expert_perm, inverse=True)
        meta = dict(meta, step=step, checksums=tree_checksums(host),
                    data_checksum=json_checksum(data_state))
        try:
            saved = self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(host), data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta)))
        except Exception as err:  # orbax's synchronous part (directories, metadata)
            raise self._save_error(step, err) from None
        if not saved:  # orbax skips a step at or before the latest one it holds
            raise RuntimeError(f"checkpoint of step {step} not written: "
                               f"{self.manager.directory} already holds step "
                               f"{self.manager.latest_step()}")
        self._pending = (step, host)

    def poll(self, *, wait: bool = False) -> None:
        """Once the last save has finished (``wait``: block until it has), read it back
        and check it; raise ``CheckpointSaveError`` if writing or the check failed.
        With several processes a poll that does not wait only looks for a failed write
        (a local check): the read-back, which may synchronise the processes, waits for
        the next save or the end, which every process reaches at the same step."""
        if self._pending is None:
            return
        step, host = self._pending
        if not wait:
            try:
                self.manager.check_for_errors()
            except Exception as err:
                raise self._save_error(step, err) from None
            if jax.process_count() > 1 or self.manager.is_saving_in_progress():
                return
        self._pending = None
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as err:
            raise self._save_error(step, err) from None
        try:
            self._read(step, host)
        except CorruptCheckpoint as err:
            raise CheckpointSaveError(f"checkpoint of step {step} reads back wrong after "
                                      f"writing: {err}") from None

    def _save_error(self, step: int, err: Exception) -> CheckpointSaveError:
        cause = _one_line(err)
        short = cause if len(cause) <= 200 else "..." + cause[-200:]
        reason = _os_error(cause)
        return CheckpointSaveError(
            f"checkpoint of step {step} could not be written to "
            f"{self.manager.directory / str(step)}: "
            + (short if reason is None else f"{reason} ({short})"))

    def _corrupt(self, step: int, what: str, target=None) -> CorruptCheckpoint:
        """The error for ``step``, with the newest earlier step that reads back intact
        (checked like ``step`` when the state's ``target`` is known) to resume from."""
        earlier = [s for s in self.all_steps() if s < step]
        intact = next((s for s in reversed(earlier)
                       if target is None or self._intact(s, target)), None)
        if intact is not None:
            checked = "intact" if target is not None else "earlier"
            how = (f"resume from the {checked} step {intact} with checkpoint.resume=true "
                   f"checkpoint.step={intact} (steps held: {earlier})")
        else:
            how = (f"no earlier checkpoint reads back intact (steps held: {earlier}): start "
                   "the run again in another out_dir")
        return CorruptCheckpoint(f"checkpoint step {step} in {self.manager.directory} is "
                                 f"corrupt: {what}; {how}")

    def _intact(self, step: int, target) -> bool:
        try:
            self._read(step, target, hint=False)
        except CorruptCheckpoint:
            return False
        return True

    def _read(self, step: int, target, *, hint: bool = True) -> dict:
        """The items of ``step`` (state restored like host tree ``target``), checked
        against the checksums in its meta; ``CorruptCheckpoint`` when they differ or a
        file is missing or unreadable (``hint``: naming an intact earlier step)."""
        def corrupt(what):
            return self._corrupt(step, what, target) if hint else CorruptCheckpoint(what)

        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(),
                meta=ocp.args.JsonRestore()))
        except Exception as err:
            cause = _one_line(err)
            tensor = re.search(r'reading "([^"/]+)', cause)  # tensorstore names the array
            what = f"tensor {tensor[1]} cannot be read" if tensor else "its files cannot be read"
            raise corrupt(f"{what} ({cause[:200]})") from None
        sums = out["meta"].get("checksums")
        if sums is None:  # written before checksums existed
            return out
        got = tree_checksums(out["state"])
        bad = sorted(k for k in set(sums) | set(got) if sums.get(k) != got.get(k))
        if bad:
            raise corrupt(f"tensor {bad[0]} differs from its checksum ({len(bad)} of "
                          f"{len(sums)} tensors differ)")
        if json_checksum(out["data"]) != out["meta"].get("data_checksum"):
            raise corrupt("the data iterator state differs from its checksum")
        return out

    def meta(self, step: int) -> dict:
        """The "meta" item of ``step`` (its step, the config and data it was written
        with, the checksums)."""
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:
            raise self._corrupt(step, f"its meta cannot be read ({_one_line(err)[:200]})") from None

    def restore(self, template: dict, place: Callable[[Any, Any], Any],
                step: int | None = None) -> tuple[dict, dict, dict]:
        """(state laid out like ``template`` and placed by ``place(saved, template_leaf)``,
        data state, meta) of ``step`` (default: the latest), checked against its
        checksums."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}: run without "
                                    "checkpoint.resume=true first")
        target = _move_experts(jax.tree.map(_to_host, template), self.expert_perm, inverse=True)
        out = self._read(step, target)
        mismatched = [(jax.tree_util.keystr(path), np.shape(a), np.shape(b)) for (path, a), b
                      in zip(jax.tree_util.tree_leaves_with_path(out["state"]),
                             jax.tree.leaves(target)) if np.shape(a) != np.shape(b)]
        if mismatched:
            name, found, expected = mismatched[0]
            raise ValueError(f"checkpoint step {step}: {name} has shape {found}, the model "
                             f"expects {expected} ({len(mismatched)} tensors differ); resume "
                             "with the model config the run was written with")
        _check_logical_layouts(out["state"], step)
        saved = _move_experts(out["state"], self.expert_perm, inverse=False)
        state = jax.tree.map(lambda s, t: place(_from_host(s, t), t), saved, template)
        return state, out["data"], out["meta"]

    def delete_after(self, step: int) -> list[int]:
        """Delete the checkpoints after ``step`` (a resume from an earlier step writes
        them anew); returns their steps."""
        later = [s for s in self.all_steps() if s > step]
        for s in later:
            self.manager.delete(s)
        return later

    def wait(self) -> None:
        """Block until the last save is written and verified."""
        self.poll(wait=True)

    def close(self) -> None:
        self.manager.close()
