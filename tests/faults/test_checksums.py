"""Checkpoint values changed without breaking the files (silent corruption that the
storage layer cannot see: a bit flip in memory before the write, a tool that rewrote
an array) are caught by the checksums, naming the tensor and the step."""

from __future__ import annotations

import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

from aristax.train.checkpoint import Checkpointer, CorruptCheckpoint, checksum


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"model": {"w": rng.standard_normal((4, 3)).astype(np.float32),
                      "b": rng.standard_normal(3).astype(np.float32)},
            "optimizer": {"count": np.asarray(seed, np.int32)}}


def save_steps(directory, steps) -> Checkpointer:
    ckpt = Checkpointer(directory, keep=5)
    for step in steps:
        ckpt.save(step, state(step), {"position": step}, {"name": "t"})
    ckpt.wait()
    return ckpt


def rewrite_state(directory, step: int, change) -> None:
    """Rewrite the "state" item of ``step`` with orbax itself, ``change`` applied: the
    files stay valid, only the values differ from what was checksummed."""
    item = directory / str(step) / "state"
    with ocp.StandardCheckpointer() as checkpointer:
        values = checkpointer.restore(item)
        change(values)
        shutil.rmtree(item)
        checkpointer.save(item, values)


def test_a_changed_tensor_is_named_with_the_step_to_resume_from(tmp_path):
    ckpt = save_steps(tmp_path, [1, 2])
    rewrite_state(tmp_path, 2, lambda v: v["model"]["w"].__setitem__((1, 2), 7.0))
    with pytest.raises(CorruptCheckpoint, match=r"step 2 .*tensor model.w "
                                                r"differs.*checkpoint.step=1"):
        ckpt.restore(state(0), lambda saved, template: saved, 2)
    restored, data, meta = ckpt.restore(state(0), lambda saved, template: saved, 1)
    assert checksum(restored["model"]["w"]) == checksum(state(1)["model"]["w"])
    assert data == {"position": 1} and meta["step"] == 1
    ckpt.close()


def test_the_hint_skips_earlier_checkpoints_that_are_corrupt_too(tmp_path):
    ckpt = save_steps(tmp_path, [1, 2, 3])
    for step in (2, 3):
        rewrite_state(tmp_path, step, lambda v: v["model"]["b"].__setitem__(0, -1.0))
    with pytest.raises(CorruptCheckpoint, match=r"step 3 .*tensor model.b differs.*intact "
                                                r"step 1 .*checkpoint.step=1 "):
        ckpt.restore(state(0), lambda saved, template: saved, 3)
    ckpt.close()


def test_a_changed_data_state_is_refused(tmp_path):
    ckpt = save_steps(tmp_path, [3])
    data = tmp_path / "3" / "data" / "metadata"  # orbax's JSON item: {"position": 3}
    data.write_text(data.read_text().replace("3", "4"))
    with pytest.raises(CorruptCheckpoint, match="data iterator state.*no earlier checkpoint "
                                                "reads back intact"):
        ckpt.restore(state(0), lambda saved, template: saved, 3)
    ckpt.close()


def test_checksums_see_dtype_shape_and_values():
    a = np.arange(6, dtype=np.float32)
    assert checksum(a) == checksum(a.copy())
    assert len({checksum(a), checksum(a.reshape(2, 3)), checksum(a.astype(np.float64)),
                checksum(np.where(a == 5, np.nextafter(a, np.float32(9)), a))}) == 4


def test_experts_stored_in_another_order_are_refused(tmp_path):
    """A checkpoint whose expert_layout is not the logical order (written by other
    code, with valid checksums) would restore each expert's weights into another
    expert's slot: it is refused, naming the layer."""
    perm = [2, 3, 0, 1]
    layer = lambda layout: {"expert_layout": np.asarray(layout, np.int32),  # noqa: E731
                            "experts": {"up_edf": np.arange(24, dtype=np.float32
                                                            ).reshape(4, 2, 3)}}
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(1, {"model": {"moe": layer(range(4))}}, {"position": 1}, {"name": "t"})
    ckpt.save(2, {"model": {"moe": layer(perm)}}, {"position": 2}, {"name": "t"})
    ckpt.wait()
    restoring = Checkpointer(tmp_path, keep=2, expert_perm=perm)
    template = {"model": {"moe": layer(perm)}}
    with pytest.raises(ValueError, match=r"step 2: model.moe.expert_layout is \[2, 3, 0, 1\]"
                                         r", not the logical expert order"):
        restoring.restore(template, lambda saved, template: saved, 2)
    restored, _, _ = restoring.restore(template, lambda saved, template: saved, 1)
    assert restored["model"]["moe"]["expert_layout"].tolist() == perm
    ckpt.close()
    restoring.close()
