"""Autoregressive generation with a fixed-size KV cache: one compiled prefill, one
compiled decode step.

Letters: B batch, S prompt length, N new tokens, L = S + N cache slots, V vocabulary.

Left-padded batches follow Hugging Face ``generate``: position ids are
``cumsum(attention_mask) - 1`` (0 on padding), padding keys are masked, each new token
takes the next position of its row, and rows that emitted an EOS token continue with
``pad_token_id`` until every row is done (then generation stops early). As there, the
EOS and pad ids, and whether and how to sample, default to the model's
``generation_config`` (a checkpoint's generation_config.json, else made from its
config.json: ``aristax.models.generation_config``; HF's defaults: greedy, and when
sampling top-k 50), and without an ``attention_mask`` one is inferred from the pad id
when the prompts hold it (and it is not an EOS id).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aristax.models.decoder import DecodeWeights, DecoderLM, KVCache, check_token_ids


# --------------------------------------------------------------------- sampling
def top_p_mask(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """HF ``TopPLogitsWarper``: logits with the tokens outside the nucleus set to -inf.

    Sorts ascending, removes tokens whose cumulative probability is <= 1 - top_p and
    always keeps the most likely token. logits: float32[B, V]; top_p: float32[].
    """
    order = jnp.argsort(logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    remove_sorted = cum <= 1.0 - top_p
    remove_sorted = remove_sorted.at[:, -1].set(False)
    remove = jnp.zeros_like(remove_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order].set(remove_sorted)
    return jnp.where(remove, -jnp.inf, logits)


def top_k_mask(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """HF ``TopKLogitsWarper``: logits below the k-th largest set to -inf (ties with it
    kept); top_k <= 0 or >= V keeps all. logits: float32[B, V]; top_k: int32[]."""
    V = logits.shape[-1]
    k = jnp.where(top_k <= 0, V, jnp.minimum(top_k, V))
    kth = jnp.take(jnp.sort(logits, axis=-1), V - k, axis=-1)
    return jnp.where(logits < kth[:, None], -jnp.inf, logits)


def next_token(logits, rng, temperature, top_k, top_p, do_sample: bool) -> jax.Array:
    """int32[B] from the last logits float[B, V]: argmax, or sampling after HF's
    warpers in HF's order: temperature, top-k, top-p. The logits are shifted by their
    row maximum before the temperature divides them (every warper and the softmax are
    shift-invariant), so a tiny temperature tends to argmax instead of overflowing to
    inf and NaN."""
    logits = logits.astype(jnp.float32)
    if not do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    logits = top_p_mask(top_k_mask(shifted / temperature, top_k), top_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _emit(tok, done, eos_ids: jax.Array, pad_id: jax.Array):
    """Finished rows emit ``pad_id``; a row is done once it emitted one of ``eos_ids``
    (int32[n], n >= 0)."""
    tok = jnp.where(done, pad_id, tok)
    return tok, done | jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)


# --------------------------------------------------------------------- compiled steps
class _Structure:
    """A model's structure (``nnx.split``'s graphdef) as a static jit argument that
    hashes once.

    ``jax.jit`` hashes its static arguments on every call, and hashing a graphdef each
    decode step would cost about 5 ms for a 12-layer model (7% of a CPU step); so
    ``generate`` wraps the graphdef once per call, which hashes it once. JAX then
    compares a call's static arguments with the cached ones by ``==``, identity first:
    two equal structures holding different graphdef objects share one graphdef once
    compared, so later steps compare by identity.
    """

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Structure) or self._hash != other._hash:
            return False
        if self.graphdef is other.graphdef:
            return True
        if self.graphdef != other.graphdef:
            return False
        other.graphdef = self.graphdef  # equal values: share one object
        return True


def _prefill(structure: _Structure, state, decode_weights, input_ids, attention_mask,
             position_ids, rng, temperature, top_k, top_p, eos_ids, pad_id, *, cache_length,
             do_sample):
    model = nnx.merge(structure.graphdef, state)
    B = input_ids.shape[0]
    cache = KVCache.init(model.config, B, cache_length)
    out = model(input_ids, attention_mask, position_ids, cache=cache,
                decode_weights=decode_weights, last_only=True)
    rng, key = jax.random.split(rng)
    tok = next_token(out.logits[:, -1], key, temperature, top_k, top_p, do_sample)
    tok, done = _emit(tok, jnp.zeros((B,), bool), eos_ids, pad_id)
    return tok, done, out.cache, position_ids[:, -1] + 1, rng


def _decode(structure: _Structure, state, decode_weights, tok, done, cache, position, rng,
            temperature, top_k, top_p, eos_ids, pad_id, *, do_sample):
    model = nnx.merge(structure.graphdef, state)
    out = model(tok[:, None], None, position[:, None], cache=cache,
                decode_weights=decode_weights)
    rng, key = jax.random.split(rng)
    nxt = next_token(out.logits[:, -1], key, temperature, top_k, top_p, do_sample)
    nxt, done = _emit(nxt, done, eos_ids, pad_id)
    return nxt, done, out.cache, position + 1, rng


# The compiled steps live in JAX's own jit cache of these two module-level functions
# (no cache of ours): an entry per model structure (the ``structure`` static argument:
# layer count, sizes, MoE plan and layout, dtypes, ...), per ``do_sample`` and, for the
# prefill, per ``cache_length`` (prompt length + max_new_tokens), and per shape, dtype
# and sharding of the array arguments (batch, prompt length). Sampling values
# (temperature, top_k, top_p, EOS and pad ids) are arrays: changing them compiles nothing.
# ``jax.clear_caches()`` empties it. The decode step donates the cache.
prefill_step = jax.jit(_prefill, static_argnames=("structure", "cache_length", "do_sample"))
decode_step = jax.jit(_decode, static_argnames=("structure", "do_sample"),
                      donate_argnames=("cache",))


# --------------------------------------------------------------------- driver
@dataclasses.dataclass
class GenerationStats:
    """Wall-clock seconds of the prefill (which yields the first token), of the first
    decode step (which includes compiling it when cold), and of the other
    ``decode_steps`` decode steps (steady state), each also in ``step_s``."""

    prefill_s: float
    first_step_s: float
    decode_s: float
    decode_steps: int
    step_s: tuple[float, ...] = ()

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * self.decode_s / max(self.decode_steps, 1)

    @classmethod
    def from_times(cls, t0: float, times: Sequence[float]) -> GenerationStats:
        """From the start time and the time each token (prefill's, then each decode
        step's) was read."""
        first = times[1] - times[0] if len(times) > 1 else 0.0
        steps = tuple(np.diff(times)[1:].tolist())
        return cls(prefill_s=times[0] - t0, first_step_s=first,
                   decode_s=times[-1] - times[0] - first, decode_steps=len(steps),
                   step_s=steps)


def _check_arguments(ids: np.ndarray, max_new_tokens, temperature, top_k, top_p,
                     vocab_size: int) -> None:
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or 0 in ids.shape:
        raise ValueError(f"input_ids must be an integer array [batch, seq] of at least one "
                         f"token, got {ids.dtype}{list(ids.shape)}")
    if (not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool)
            or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if not temperature >= 0:  # NaN too
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 = off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    check_token_ids(ids, vocab_size)


def _check_left_padded(mask: np.ndarray, inferred_from_pad: int | None) -> None:
    name = ("attention_mask" if inferred_from_pad is None else "the attention_mask "
            f"inferred from pad_token_id={inferred_from_pad} (as Hugging Face infers it)")
    if not np.all(np.diff(mask.astype(np.int8), axis=1) >= 0):
        raise ValueError(f"{name} must be left-padded (0s before 1s in every row); pad "
                         "prompts on the left as Hugging Face generate expects")
    if not np.all(mask[:, -1]):
        raise ValueError(f"{name}: every prompt needs at least one real token")


def _pad_marks_padding(ids: np.ndarray, pad: int | None, eos: tuple[int, ...]) -> bool:
    """Hugging Face's rule for prompts without an attention mask: the pad id marks
    padding when there is one, the prompts hold it and it is not an EOS id."""
    return pad is not None and bool(np.any(ids == pad)) and pad not in eos


def _prompt_mask(ids: np.ndarray, attention_mask, pad: int | None,
                 eos: tuple[int, ...]) -> np.ndarray:
    """bool[B, S] real-token mask of the int[B, S] prompts: ``attention_mask``, else
    inferred from the pad id (``_pad_marks_padding``), else all real; checked to be
    left-padded."""
    inferred_from = None
    if attention_mask is not None:
        mask = np.asarray(attention_mask) != 0
    elif _pad_marks_padding(ids, pad, eos):
        mask, inferred_from = ids != pad, pad
    else:
        mask = np.ones(ids.shape, bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {mask.shape}, input_ids {ids.shape}")
    _check_left_padded(mask, inferred_from)
    return mask


def _sampling(model: DecoderLM, temperature, top_k, top_p) -> tuple[float, int, float]:
    """(temperature, top_k, top_p), each the model's generation config's where None:
    its temperature when it samples (``do_sample``), else 0 (greedy)."""
    gen = model.generation_config
    if temperature is None:
        temperature = gen.temperature if gen.do_sample else 0.0
    return (temperature, gen.top_k if top_k is None else top_k,
            gen.top_p if top_p is None else top_p)


def _special_ids(model: DecoderLM, eos_token_id, pad_token_id
                 ) -> tuple[tuple[int, ...], int | None]:
    """(EOS ids, pad id or None) as Hugging Face resolves them: the generation
    config's, else the model config's, where not given; the pad id falling back to
    the first EOS id. EOS ids outside the vocabulary, which no step can produce, are
    refused, given or read from the configs."""
    given = eos_token_id is not None
    pad_given = pad_token_id is not None
    gen = model.generation_config
    for source in (gen, model.config):
        eos_token_id = source.eos_token_id if eos_token_id is None else eos_token_id
        pad_token_id = source.pad_token_id if pad_token_id is None else pad_token_id
    eos = () if eos_token_id is None else tuple(int(e) for e in np.atleast_1d(eos_token_id))
    vocab = model.config.vocab_size
    outside = [e for e in eos if not 0 <= e < vocab]
    if outside:
        where = "" if given else " (the model's generation config or config.json)"
        raise ValueError(f"eos_token_id {outside[0]}{where} is outside this model's "
                         f"vocabulary [0, {vocab}), so generation would never stop at it; "
                         "give an id in range, or none (() here, -1 on the command line)")
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    if pad_token_id is not None and not 0 <= int(pad_token_id) < vocab:
        where = "" if pad_given else " (the model's generation config or config.json)"
        raise ValueError(f"pad_token_id {pad_token_id}{where} is outside this model's "
                         f"vocabulary [0, {vocab}), and finished rows would be filled with "
                         "it; give an id in range")
    return eos, pad_token_id


def _stop_ids(eos: tuple[int, ...], pad: int | None) -> tuple[np.ndarray, np.int32]:
    """(int32[max(4, n)] EOS ids padded with -1, never a token, to a fixed length so
    that their count compiles nothing; int32[] pad id, 0 and unused without one, as
    there is then no EOS)."""
    eos_padded = np.full(max(4, len(eos)), -1, np.int32)
    eos_padded[:len(eos)] = eos
    return eos_padded, np.int32(0 if pad is None else pad)


def _run_steps(prefill: Callable, step: Callable, max_new_tokens: int, stops: bool
               ) -> tuple[list[np.ndarray], list[float], float]:
    """Runs ``prefill()`` then up to ``max_new_tokens - 1`` ``step(carry)`` calls, each
    carry starting with the int32[B] tokens and the bool[B] done rows; stops early once
    every row is done when ``stops`` (there are EOS ids).

    One step is dispatched ahead: step i + 1 is queued (its inputs are step i's device
    arrays) before step i's token is read, so the host's dispatch work overlaps the
    device's compute. A step queued past the last EOS is discarded.
    Returns (the int[B] tokens read, the time each was read, the start time).
    """
    tokens, times = [], []

    def fetch(carry) -> bool:
        """Wait for a step's token; True when every row is done (EOS seen)."""
        tokens.append(np.asarray(carry[0]))
        times.append(time.perf_counter())
        return stops and bool(np.all(np.asarray(carry[1])))

    t0 = time.perf_counter()
    carry = prefill()
    all_done = fetch(carry)
    ahead = step(carry) if max_new_tokens > 1 and not all_done else None
    for i in range(1, max_new_tokens):
        if all_done:
            break
        carry = ahead
        ahead = step(carry) if i + 1 < max_new_tokens else None
        all_done = fetch(carry)
    return tokens, times, t0


def generate_with_stats(
    model: DecoderLM,
    input_ids,
    max_new_tokens: int,
    *,
    attention_mask=None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    rng: jax.Array | None = None,
    decode_weights: DecodeWeights | None = None,
) -> tuple[np.ndarray, GenerationStats]:
    """``generate`` that also returns ``GenerationStats``.

    The compiled steps are ``prefill_step`` and ``decode_step``, kept in JAX's jit
    cache (see there): a second call with the same model structure, shapes and
    ``do_sample`` compiles nothing.
    """
    ids = np.asarray(input_ids)
    if rng is not None and not (isinstance(rng, jax.Array) and (
            jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) or rng.dtype == jnp.uint32)):
        raise TypeError(f"rng must be a JAX PRNG key such as jax.random.key(0), got {rng!r}")
    given = [name for name, v in (("top_k", top_k), ("top_p", top_p)) if v is not None]
    temperature, top_k, top_p = _sampling(model, temperature, top_k, top_p)
    _check_arguments(ids, max_new_tokens, temperature, top_k, top_p, model.config.vocab_size)
    if temperature == 0 and given:
        warnings.warn(f"{' and '.join(given)}: applied only when sampling (temperature > 0); "
                      "this greedy decoding ignores it", UserWarning, stacklevel=3)
    eos, pad = _special_ids(model, eos_token_id, pad_token_id)
    mask = _prompt_mask(ids, attention_mask, pad, eos)
    position_ids = np.where(mask, np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    do_sample = temperature > 0
    rng = jax.random.key(0) if rng is None else rng
    sampling = (np.float32(temperature if do_sample else 1.0), np.int32(top_k),
                np.float32(top_p),
                *_stop_ids(eos, pad))
    if decode_weights is None:
        decode_weights = model.decode_weights()
    graphdef, state = nnx.split(model)
    structure = _Structure(graphdef)  # hashed here, once per call

    def prefill():
        return prefill_step(structure, state, decode_weights, ids.astype(np.int32), mask,
                            position_ids, rng, *sampling,
                            cache_length=ids.shape[1] + max_new_tokens, do_sample=do_sample)

    def step(carry):
        return decode_step(structure, state, decode_weights, *carry, *sampling,
                           do_sample=do_sample)

    tokens, times, t0 = _run_steps(prefill, step, max_new_tokens, bool(eos))
    # the prompt's dtype when it holds every id of the vocabulary (a uint8 prompt of a
    # larger vocabulary would wrap the new ids), else int32
    holds = np.iinfo(ids.dtype).max >= model.config.vocab_size - 1
    out = np.concatenate([ids, np.stack(tokens, axis=1)], axis=1).astype(
        ids.dtype if holds else np.int32)
    return out, GenerationStats.from_times(t0, times)


def generate(
    model: DecoderLM,
    input_ids,
    max_new_tokens: int,
    *,
    attention_mask=None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    rng: jax.Array | None = None,
    decode_weights: DecodeWeights | None = None,
) -> np.ndarray:
    """Generate up to ``max_new_tokens`` tokens after left-padded prompts.

    Args:
      model: a ``Mixtral`` or ``Qwen3Moe`` (any ``DecoderLM``).
      input_ids: int[B, S] prompts, left-padded to a common length S; ids in
        [0, vocab_size).
      max_new_tokens: N, tokens to generate per row.
      attention_mask: [B, S] 1 for real tokens, 0 for left padding (None: inferred
        from the pad id as HF does, see ``pad_token_id``, else all real).
      temperature: 0 = greedy (argmax); > 0 samples softmax(logits / temperature)
        (default: the generation config's when it samples, ``do_sample``, else 0).
      top_k: when sampling, keep the k most likely tokens (HF ``TopKLogitsWarper``;
        0 = off; default: the generation config's, HF's 50 where it names none).
      top_p: when sampling, the nucleus threshold (HF ``TopPLogitsWarper``) after
        top-k (default: the generation config's, 1.0 where it names none).
      eos_token_id: id or ids that end a row; generation stops when all rows ended
        (default: ``model.generation_config``'s, else ``model.config``'s, as HF;
        ``()`` for none).
      pad_token_id: emitted by ended rows (default: the generation config's, else
        ``model.config``'s, else the first EOS id, as HF). Without
        ``attention_mask``, prompts holding it are taken as padded with it (HF's
        rule; not when it is an EOS id).
      rng: PRNG key for sampling (default ``jax.random.key(0)``).
      decode_weights: ``model.decode_weights()`` made once and reused across calls
        (default: made per call, which copies the streamed weights).
    Returns:
      int[B, S + n] numpy array, prompts followed by the n <= N generated tokens.
    """
    out, _ = generate_with_stats(
        model, input_ids, max_new_tokens, attention_mask=attention_mask,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, rng=rng, decode_weights=decode_weights)
    return out
