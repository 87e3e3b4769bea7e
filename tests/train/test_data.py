"""The grain data pipeline: sources, windows, per-process shards, resumable state."""

from __future__ import annotations

import numpy as np
import pytest

from aristax.train import data as data_lib
from aristax.train.config import DataConfig


def test_windows_are_shifted_pairs_of_the_stream_and_cover_it_per_epoch():
    tokens = np.arange(1001, dtype=np.int32)
    it = data_lib.batches(tokens, 10, 4, seed=3)
    seen = np.concatenate([next(it) for _ in range(25)])  # 100 windows = one epoch
    assert seen.shape == (100, 11)
    np.testing.assert_array_equal(seen[:, 1:] - seen[:, :-1], 1)  # consecutive tokens
    assert sorted(seen[:, 0].tolist()) == list(range(0, 1000, 10))  # each window once


def test_processes_get_disjoint_shards_of_the_same_order():
    tokens = np.arange(801, dtype=np.int32)
    first = [data_lib.batches(tokens, 8, 5, seed=1, process_index=p, process_count=2)
             for p in (0, 1)]
    a, b = (np.concatenate([next(it) for _ in range(10)])[:, 0] for it in first)
    assert not set(a.tolist()) & set(b.tolist())
    assert sorted(a.tolist() + b.tolist()) == list(range(0, 800, 8))


def test_state_resumes_exactly():
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.int32)
    it = data_lib.batches(tokens, 16, 3, seed=7)
    for _ in range(4):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = data_lib.batches(tokens, 16, 3, seed=7, state=state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)


def test_sources_directory_npy_and_tokenizer(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("world " * 50)
    (tmp_path / "docs" / "a.txt").write_text("hello " * 50)
    tokens, vocab = data_lib.read_tokens(DataConfig(source=str(tmp_path / "docs")))
    assert vocab == 256 and bytes(tokens[:6].astype(np.uint8)) == b"hello "  # sorted files
    ids = np.arange(40, dtype=np.int64) % 7
    np.save(tmp_path / "ids.npy", ids)
    tokens, vocab = data_lib.read_tokens(DataConfig(source=str(tmp_path / "ids.npy")))
    np.testing.assert_array_equal(tokens, ids)
    assert vocab == 7 and tokens.dtype == np.int32
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokens, vocab = data_lib.read_tokens(DataConfig(source=str(tmp_path / "docs"),
                                                    tokenizer=str(tmp_path / "tokenizer.json")))
    assert vocab == 3 and tokens[:3].tolist() == [0, 0, 0] and set(tokens.tolist()) == {0, 1}


def test_bad_sources_and_short_splits_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.source=.*missing' does not exist"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "missing")))
    (tmp_path / "book.txt").write_text("a plain text file")
    with pytest.raises(FileNotFoundError, match="book.txt' is a file.*directory of their own"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "book.txt")))
    with pytest.raises(ValueError, match="held-out split"):
        data_lib.split(np.arange(100, dtype=np.int32), 0.05, 32)


def test_bad_npy_and_tokenizer_files_name_the_config_key(tmp_path):
    np.save(tmp_path / "floats.npy", np.array([0.7, 1.9, 2.5]))
    with pytest.raises(ValueError, match=r"data.source=.*floats.npy.*float64.*integer dtype"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "floats.npy")))
    np.save(tmp_path / "rows.npy", np.arange(6, dtype=np.int32).reshape(2, 3))
    with pytest.raises(ValueError, match=r"rows.npy' holds an array of shape \(2, 3\), not a "
                                         r"1-D array.*reshape\(-1\)"):  # was flattened
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "rows.npy")))
    np.save(tmp_path / "empty.npy", np.array([], dtype=np.int32))
    with pytest.raises(ValueError, match=r"data.source=.*empty.npy.*no token ids"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "empty.npy")))
    with pytest.raises(FileNotFoundError, match=r"data.source=.*missing.npy"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "missing.npy")))
    pytest.importorskip("tokenizers")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello " * 50)
    missing = str(tmp_path / "nonexistent.json")
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer=.*nonexistent.json"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "docs"), tokenizer=missing))
    with pytest.raises(FileNotFoundError, match=r"data.tokenizer=.*docs' is a directory"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "docs"),
                                        tokenizer=str(tmp_path / "docs")))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"data.tokenizer=.*broken.json.*tokenizer.json"):
        data_lib.read_tokens(DataConfig(source=str(tmp_path / "docs"),
                                        tokenizer=str(tmp_path / "broken.json")))
