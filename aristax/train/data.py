"""Training data: token streams packed into sequences, through a grain pipeline.

Sources (``DataConfig.source``):
  * "stdlib": the Python standard library's ``.py`` files, read as bytes (on every
    machine with Python: the embedded default needs no download);
  * a directory: every file under it (sorted), as bytes, or through
    ``DataConfig.tokenizer`` (a Hugging Face ``tokenizer.json``);
  * a ``.npy`` file: a 1-D array of token ids, already tokenised.
The stream is split into a training head and a held-out tail, then cut into
windows of S + 1 tokens (inputs and shifted targets; consecutive windows share one
token). The grain pipeline shuffles the windows per epoch from a seed, shards them
over processes (process p takes windows p, p + P, ...), and batches; its iterator
state (one integer) makes it resumable: ``batches(..., state)`` continues exactly.
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from aristax.train.config import DataConfig


def stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: set data.source to a directory")
    return files


def read_tokens(cfg: DataConfig) -> tuple[np.ndarray, int]:
    """(int32[N] token ids, vocabulary size) from ``cfg.source``."""
    source = cfg.source
    if source.endswith(".npy"):
        if not pathlib.Path(source).is_file():
            raise FileNotFoundError(f"data.source={source!r} does not exist: give an existing "
                                    ".npy file of token ids")
        array = np.load(source)
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"data.source={source!r} holds {array.dtype} values, not integer "
                             "token ids: save the ids with an integer dtype, e.g. "
                             "np.save(path, ids.astype(np.int32))")
        if array.size == 0:
            raise ValueError(f"data.source={source!r} holds no token ids: save a non-empty "
                             "1-D array of token ids")
        tokens = array.astype(np.int32).reshape(-1)
        if tokens.min() < 0:
            raise ValueError(f"data.source={source!r} holds negative token ids")
        return tokens, int(tokens.max()) + 1
    if source == "stdlib":
        files = stdlib_files()
    else:
        root = pathlib.Path(source)
        if not root.is_dir():
            raise FileNotFoundError(f"data.source={source!r} is not 'stdlib', a directory or "
                                    "a .npy file")
        files = sorted(p for p in root.rglob("*") if p.is_file())
        if not files:
            raise FileNotFoundError(f"data.source={source!r} holds no files")
    raw, total = [], 0
    for path in files:
        raw.append(path.read_bytes())
        total += len(raw[-1])
        if total >= cfg.max_bytes:
            break
    text = b"".join(raw)[:cfg.max_bytes]
    if cfg.tokenizer is None:
        return np.frombuffer(text, np.uint8).astype(np.int32), 256
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("data.tokenizer needs the `tokenizers` package: pip install "
                          "tokenizers") from None
    if not pathlib.Path(cfg.tokenizer).is_file():
        raise FileNotFoundError(f"data.tokenizer={cfg.tokenizer!r} does not exist: give the path "
                                "of a Hugging Face tokenizer.json, or leave data.tokenizer unset "
                                "for bytes")
    try:
        tok = Tokenizer.from_file(cfg.tokenizer)
    except Exception as err:  # tokenizers raises a bare Exception
        raise ValueError(f"data.tokenizer={cfg.tokenizer!r} is not a Hugging Face tokenizer.json "
                         f"({err})") from None
    ids = tok.encode(text.decode("utf-8", errors="replace")).ids
    return np.asarray(ids, np.int32), tok.get_vocab_size()


def split(tokens: np.ndarray, held_out_fraction: float, seq_len: int):
    """(train, held_out) token arrays; each must hold at least one window."""
    cut = int(len(tokens) * (1.0 - held_out_fraction))
    train, held_out = tokens[:cut], tokens[cut:]
    for name, part in (("training", train), ("held-out", held_out)):
        if len(part) < seq_len + 1:
            raise ValueError(f"the {name} split has {len(part)} tokens, fewer than one window "
                             f"of seq_len + 1 = {seq_len + 1}; use more data or a shorter "
                             "model.seq_len")
    return train, held_out


def window_dataset(tokens: np.ndarray, seq_len: int, *, seed: int, shuffle: bool,
                   process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Endless windows int32[S + 1] of ``tokens`` (reshuffled every epoch when
    ``shuffle``), process ``process_index``'s share."""
    num = (len(tokens) - 1) // seq_len
    ds = grain.MapDataset.range(num)
    if shuffle:
        ds = ds.seed(seed).shuffle()
    ds = ds.repeat(None)[process_index::process_count]
    return ds.map(lambda i: tokens[i * seq_len:i * seq_len + seq_len + 1])


def batches(tokens: np.ndarray, seq_len: int, local_batch: int, *, seed: int,
            shuffle: bool = True, process_index: int = 0, process_count: int = 1,
            state: dict[str, Any] | None = None) -> Iterator[np.ndarray]:
    """A resumable iterator of int32[local_batch, S + 1]; ``it.get_state()`` is its
    position, ``state=`` restores it."""
    ds = window_dataset(tokens, seq_len, seed=seed, shuffle=shuffle,
                        process_index=process_index, process_count=process_count)
    it = iter(ds.batch(local_batch).to_iter_dataset())
    if state is not None:
        it.set_state(state)
    return it
