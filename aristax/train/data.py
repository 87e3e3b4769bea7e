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

# The largest vocabulary ``read_tokens`` infers from a token array's ids (max id + 1)
# without the model's vocab_size saying so: 2**21, above any common tokenizer's
# (Llama 3: 128,256; Gemma: 262,144), so a larger id is far more likely a wrong file
# or dtype than a real token, and would build an embedding table of millions of rows.
MAX_INFERRED_VOCAB = 2 ** 21
_INT32_MAX = int(np.iinfo(np.int32).max)
_NPY_MAGIC = b"\x93NUMPY"


def stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: set data.source to a directory")
    return files


def load_npy(source: str) -> np.ndarray:
    """The array in the ``.npy`` file ``source`` (``data.source``), never unpickled;
    FileNotFoundError / ValueError naming the file where it is missing, not a .npy
    file, truncated or a pickled object array."""
    path = pathlib.Path(source)
    if not path.is_file():
        state = "is not a file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"data.source={source!r} {state}: give an existing .npy file "
                                "of token ids")
    with path.open("rb") as f:
        if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
            raise ValueError(f"data.source={source!r} is not a NumPy .npy array file (it lacks "
                             "the .npy header): save the token ids with np.save(path, ids)")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as err:
        if "allow_pickle" in str(err) or "pickled" in str(err):
            raise ValueError(f"data.source={source!r} holds a pickled object array, which is "
                             "not loaded (allow_pickle=False): save integer token ids, e.g. "
                             "np.save(path, ids.astype(np.int32))") from None
        raise ValueError(f"data.source={source!r} is not a readable .npy array file "
                         f"({err}): save it again with np.save(path, ids)") from None


def check_token_array(source: str, array: np.ndarray, vocab_size: int = 0) -> int:
    """The vocabulary size the ids of ``array`` (from ``data.source=source``) need,
    max id + 1; ValueError naming the file and the fix unless they are non-negative
    integers that fit int32 and, beyond ``MAX_INFERRED_VOCAB``, below ``vocab_size``
    (the model's ``model.vocab_size``)."""
    name = f"data.source={source!r}"
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} holds {array.dtype} values, not integer token ids: save the "
                         "ids with an integer dtype, e.g. np.save(path, ids.astype(np.int32))")
    if array.ndim != 1:
        raise ValueError(f"{name} holds an array of shape {array.shape}, not a 1-D array of "
                         "token ids: save the ids as one stream, e.g. np.save(path, "
                         "ids.reshape(-1)) (documents joined end to end)")
    if array.size == 0:
        raise ValueError(f"{name} holds no token ids: save a non-empty 1-D array of token ids")
    low, high = int(array.min()), int(array.max())  # in the file's dtype: nothing wraps
    if low < 0:
        raise ValueError(f"{name} holds negative token ids (min {low}): token ids are >= 0")
    if high > _INT32_MAX:
        raise ValueError(f"{name} holds token id {high:,} ({array.dtype}), beyond the int32 "
                         f"range of token ids (max {_INT32_MAX:,}): check the file was saved "
                         "with the right dtype, or remap the ids to 0..vocab_size-1")
    if high + 1 > max(vocab_size, MAX_INFERRED_VOCAB):
        raise ValueError(f"{name} holds token id {high:,}, which needs a vocabulary of "
                         f"{high + 1:,}, above {MAX_INFERRED_VOCAB:,} (larger than any common "
                         "tokenizer's): check the file, or if the ids are right set "
                         f"model.vocab_size={high + 1} explicitly")
    return high + 1


def read_tokens(cfg: DataConfig, vocab_size: int = 0) -> tuple[np.ndarray, int]:
    """(int32[N] token ids, vocabulary size) from ``cfg.source``. ``vocab_size``: the
    model's (``model.vocab_size``); ids of a .npy file need a vocabulary of at most
    ``max(vocab_size, MAX_INFERRED_VOCAB)`` (see :func:`check_token_array`)."""
    source = cfg.source
    if source.endswith(".npy"):
        if cfg.tokenizer is not None:
            raise ValueError(f"data.tokenizer={cfg.tokenizer!r} tokenizes text, and "
                             f"data.source={source!r} holds token ids: unset data.tokenizer")
        array = load_npy(source)
        vocab = check_token_array(source, array, vocab_size)
        return array.astype(np.int32), vocab
    if source == "stdlib":
        files = stdlib_files()
    else:
        root = pathlib.Path(source)
        if not root.is_dir():
            what = ("is a file, not 'stdlib', a directory or a .npy file: put text files in a "
                    "directory of their own and give the directory"
                    if root.is_file() else "does not exist: give 'stdlib', a directory of "
                    "text files or a .npy file of token ids")
            raise FileNotFoundError(f"data.source={source!r} {what}")
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
    path = pathlib.Path(cfg.tokenizer)
    if not path.is_file():
        state = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"data.tokenizer={cfg.tokenizer!r} {state}: give the path "
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
