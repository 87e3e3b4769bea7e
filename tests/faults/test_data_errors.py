"""Issue 32: ``data.source`` token arrays that are not .npy files, hold pickles, or hold
ids that int32 cannot hold (``astype`` used to wrap them silently) or that no tokenizer
has are refused with a message naming the file, the id and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aristax.train import ConfigError, load_config
from aristax.train.config import DataConfig
from aristax.train.data import MAX_INFERRED_VOCAB, read_tokens
from aristax.train.trainer import model_vocab

ROOT = Path(__file__).resolve().parents[2]


def saved(tmp_path: Path, array: np.ndarray, name: str = "tokens.npy") -> str:
    path = tmp_path / name
    np.save(path, array, allow_pickle=True)
    return str(path)


def test_a_file_that_is_not_a_npy_array(tmp_path):
    path = tmp_path / "tokens.npy"
    path.write_text("the quick brown fox\n")
    with pytest.raises(ValueError, match="tokens.npy' is not a NumPy .npy array file"):
        read_tokens(DataConfig(source=str(path)))


def test_a_pickled_object_array_is_not_loaded(tmp_path):
    path = saved(tmp_path, np.array([1, "a", None], dtype=object))
    with pytest.raises(ValueError, match=r"pickled object array.*allow_pickle=False"):
        read_tokens(DataConfig(source=path))


@pytest.mark.parametrize("dtype, high", [(np.int64, 2 ** 31), (np.uint32, 2 ** 31 + 5),
                                         (np.int64, 2 ** 32 + 5),  # wrapped to 5 before
                                         (np.uint64, 2 ** 63)])
def test_ids_beyond_int32_are_refused_not_wrapped(tmp_path, dtype, high):
    path = saved(tmp_path, np.array([1, high, 3], dtype=dtype))
    with pytest.raises(ValueError, match=rf"tokens.npy' holds token id {high:,} "
                                         rf"\({np.dtype(dtype)}\), beyond the int32 range"):
        read_tokens(DataConfig(source=path))


def test_an_inferred_vocabulary_above_2_to_the_21_is_refused(tmp_path):
    ok = saved(tmp_path, np.array([0, MAX_INFERRED_VOCAB - 1], np.int64), "ok.npy")
    tokens, vocab = read_tokens(DataConfig(source=ok))
    assert tokens.dtype == np.int32 and vocab == MAX_INFERRED_VOCAB == 2_097_152
    big = saved(tmp_path, np.array([0, 5_000_000], np.int32), "big.npy")
    with pytest.raises(ValueError, match=r"big.npy' holds token id 5,000,000, which needs a "
                                         r"vocabulary of 5,000,001.*model.vocab_size=5000001"):
        read_tokens(DataConfig(source=big))
    # the model's vocab_size, when it is that large, allows them
    assert read_tokens(DataConfig(source=big), 5_000_001)[1] == 5_000_001


def test_a_tokenizer_for_token_ids_is_refused(tmp_path):
    """data.tokenizer with a .npy source was silently unused (a user trial)."""
    path = saved(tmp_path, np.array([1, 2, 3], np.int32))
    with pytest.raises(ValueError, match=r"data.tokenizer='tok.json' tokenizes text, and "
                                         r"data.source=.*tokens.npy' holds token ids"):
        read_tokens(DataConfig(source=path, tokenizer="tok.json"))


def test_negative_ids_name_the_minimum(tmp_path):
    path = saved(tmp_path, np.array([3, -7, 2], np.int64))
    with pytest.raises(ValueError, match=r"negative token ids \(min -7\)"):
        read_tokens(DataConfig(source=path))


def test_train_refuses_them_in_one_line_before_training(tmp_path):
    path = saved(tmp_path, np.array([1, 2 ** 32 + 5] * 100, np.int64))
    env = {k: v for k, v in os.environ.items() if k != "ARISTAX_DEBUG"}
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run([sys.executable, "-m", "aristax", "train",
                          "experiments/configs/tiny.yaml", f"data.source={path}",
                          f"out_dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aristax train: data.source="), run.stderr
    assert "4,294,967,301" in lines[0]


def test_a_set_vocab_size_below_the_data_ids_is_refused(tmp_path):
    """model.vocab_size=100 with ids up to 199: refused before any work (it used to be
    raised silently to the data's 200); unset, the data's vocabulary is taken."""
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.arange(200, dtype=np.int32))
    cfg = load_config("experiments/configs/tiny.yaml", [f"data.source={tokens}",
                                                         "model.vocab_size=100"])
    with pytest.raises(ConfigError, match=r"model.vocab_size=100 .* needs 200"):
        model_vocab(cfg, 200)
    assert model_vocab(load_config("experiments/configs/tiny.yaml", []), 200) == 200
    assert model_vocab(load_config("experiments/configs/tiny.yaml", []), 150, 200) == 200
    assert model_vocab(load_config("experiments/configs/tiny.yaml", ["model.vocab_size=300"]),
                       200) == 300
