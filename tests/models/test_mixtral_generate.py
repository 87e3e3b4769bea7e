"""generate(): one compiled prefill and one compiled decode step, top-p sampling against
HF's TopPLogitsWarper, argument errors, and the ``aristax generate`` CLI."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from aristax import cli
from aristax.models import cli as models_cli
from aristax.models import forward, generate
from aristax.models.generate import top_p_mask
from compiles import count_compiles

# the module (``aristax.models.generate`` the attribute is the exported function)
gen_lib = importlib.import_module("aristax.models.generate")


def test_one_prefill_and_one_decode_compile(small_pair):
    """12 new tokens: exactly one prefill and one decode-step compilation; new sampling
    values (temperature, top_p, EOS ids) reuse the compiled steps."""
    model = small_pair.ours
    ids = np.random.default_rng(0).integers(3, 100, size=(2, 5))  # shapes no other test uses
    model.decode_weights(), jax.random.key(0)  # warm the eager helpers
    prefill, decode = gen_lib.prefill_step, gen_lib.decode_step
    prefill0, decode0 = prefill._cache_size(), decode._cache_size()
    with count_compiles() as compiles:
        out = generate(model, ids, 12)
    assert out.shape == (2, 17)
    assert len(compiles) == 2, compiles
    assert prefill._cache_size() == prefill0 + 1
    assert decode._cache_size() == decode0 + 1
    generate(model, ids, 12, temperature=0.5, top_p=0.9, eos_token_id=[5, 6])
    with count_compiles() as compiles:
        generate(model, ids, 12, temperature=0.7, top_p=0.8, eos_token_id=9, pad_token_id=1)
    assert compiles == []


def test_second_call_reuses_the_compiled_steps(small_pair, monkeypatch):
    """The compiled steps live in JAX's jit cache (no cache of ours): a second call with
    the same shapes, and a call on another instance of the same model structure,
    compile and trace nothing, and each call hashes the model's graphdef once, not once
    per decode step."""
    model = small_pair.ours
    ids = np.random.default_rng(2).integers(3, 100, size=(3, 4))  # shapes no other test uses
    generate(model, ids, 10)
    sizes = gen_lib.prefill_step._cache_size(), gen_lib.decode_step._cache_size()
    graphdef_type = type(nnx.graphdef(model))
    hashes = []
    unpatched = graphdef_type.__hash__
    monkeypatch.setattr(graphdef_type, "__hash__",
                        lambda self: hashes.append(1) or unpatched(self))
    twin = type(model).from_pretrained(small_pair.path)  # another graphdef object
    for m in (model, twin):
        hashes.clear()
        with count_compiles() as compiles:
            out = generate(m, ids, 10)
        assert compiles == [] and len(hashes) == 1, (compiles, len(hashes))
        assert out.shape == (3, 14)
    assert (gen_lib.prefill_step._cache_size(), gen_lib.decode_step._cache_size()) == sizes


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.7, 0.95])
def test_top_p_mask_matches_hf_warper(top_p):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(int(top_p * 100))) * 3
    ref = transformers.generation.TopPLogitsWarper(top_p)(None, logits.clone()).numpy()
    ours = np.asarray(top_p_mask(jnp.asarray(logits.numpy()), jnp.float32(top_p)))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    np.testing.assert_array_equal(ours[~np.isinf(ours)], ref[~np.isinf(ref)])
    assert np.isinf(ours).any() or top_p > 0.9  # the nucleus really cuts


def test_sampling(small_pair):
    model = small_pair.ours
    ids = np.random.default_rng(1).integers(3, 100, size=(1, 9))
    greedy = generate(model, ids, 32)
    # a tiny top_p keeps only the argmax token: sampling then equals greedy
    np.testing.assert_array_equal(
        generate(model, ids, 32, temperature=1.0, top_p=1e-6, rng=jax.random.key(3)), greedy)
    a = generate(model, ids, 32, temperature=1.5, rng=jax.random.key(1))
    b = generate(model, ids, 32, temperature=1.5, rng=jax.random.key(1))
    c = generate(model, ids, 32, temperature=1.5, rng=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and (a != greedy).any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k=-1"), (dict(top_k=2.5), "top_k=2.5"),
    (dict(attention_mask=np.array([[1, 1, 0]])), "left-padded"),
    (dict(attention_mask=np.array([[1, 1]])), "shape"),
    (dict(input_ids=np.zeros(3, np.int32)), "input_ids"),
    # an id past the vocabulary gave NaN embeddings, -1 wrapped to the last token
    (dict(input_ids=np.array([[1, 160, 3]])), r"input_ids hold ids from 1 to 160.*\[0, 160\)"),
    (dict(input_ids=np.array([[-1, 3]])), r"from -1 to 3, outside .* vocabulary"),
    # a mask inferred from the pad id (no attention_mask given) must be left-padded too
    (dict(input_ids=np.array([[5, 0, 3]]), pad_token_id=0), "inferred from pad_token_id=0"),
    # user trials: an empty prompt gave an IndexError, a pad id outside the vocabulary
    # filled finished rows with it
    (dict(input_ids=np.zeros((1, 0), np.int32)), "at least one token"),
    (dict(input_ids=np.zeros((0, 3), np.int32)), "at least one token"),
    (dict(pad_token_id=160, eos_token_id=2), r"pad_token_id 160 is outside .*\[0, 160\)"),
    (dict(pad_token_id=-1, eos_token_id=2), r"pad_token_id -1 is outside"),
])
def test_generate_argument_errors(small_pair, kwargs, match):
    args = dict(input_ids=np.ones((1, 3), np.int32), max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(small_pair.ours, args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_generate_takes_numpy_counts_and_refuses_a_key_that_is_not_one(small_pair):
    ids = np.ones((1, 3), np.int32)
    want = generate(small_pair.ours, ids, 3)
    np.testing.assert_array_equal(generate(small_pair.ours, ids, np.int64(3)), want)
    with pytest.raises(TypeError, match="rng must be a JAX PRNG key"):
        generate(small_pair.ours, ids, 2, temperature=1.0, rng=3)
    with pytest.warns(UserWarning, match="top_k: applied only when sampling"):
        np.testing.assert_array_equal(generate(small_pair.ours, ids, 3, top_k=1), want)


def test_new_ids_are_not_wrapped_by_a_small_prompt_dtype(small_pair):
    """A user trial: a uint8 prompt of a larger vocabulary got its new ids cast to
    uint8 (325 -> 69). The output keeps the prompt's dtype only when it holds every id."""
    ids = np.array([[7, 200 % 160, 3]])
    want = generate(small_pair.ours, ids.astype(np.int32), 12)
    assert want.max() > 127  # ids past int8's range came out (vocabulary 160)
    for dtype in (np.uint8, np.int8, np.int16):
        got = generate(small_pair.ours, ids.astype(dtype), 12)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == (dtype if np.iinfo(dtype).max >= 159 else np.int32)


def test_a_tiny_temperature_samples_the_argmax(small_pair):
    """A user trial: temperature 1e-40 made logits / temperature overflow to inf and
    the softmax NaN, and sampling returned tokens 0 and 1. The limit is greedy."""
    ids = np.array([[5, 9, 3], [1, 2, 4]])
    greedy = generate(small_pair.ours, ids, 6)
    for t in (1e-30, 1e-40, 1e-45):
        got = generate(small_pair.ours, ids, 6, temperature=t, top_k=0, rng=jax.random.key(1))
        np.testing.assert_array_equal(got, greedy)


def test_model_call_names_a_bad_argument(small_pair):
    """User trials: wrong mask or position shapes, a list of ids, and a cache that is
    too short or of another batch gave broadcasting errors, or (a full cache) wrong
    logits with no error: dynamic_update_slice clamps the write to the last slot."""
    from aristax.models import KVCache

    model, ids = small_pair.ours, jnp.asarray([[3, 4, 5]])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 4\); it must be"):
        forward(model, ids, jnp.ones((1, 4)))
    with pytest.raises(ValueError, match=r"position_ids has shape \(3,\)"):
        model(ids, position_ids=jnp.arange(3))
    with pytest.raises(TypeError, match="input_ids must be an integer array"):
        forward(model, [[3, 4, 5]])
    cache = KVCache.init(model.config, batch=1, length=4)
    out = model(ids, cache=cache)
    model(jnp.asarray([[6]]), cache=out.cache)  # the fourth slot: fits
    with pytest.raises(ValueError, match="the cache has 4 slots, 3 written, and 2 more"):
        model(jnp.asarray([[6, 7]]), cache=out.cache)
    with pytest.raises(ValueError, match="the cache holds 1 rows and input_ids 2"):
        model(jnp.asarray([[6], [7]]), cache=out.cache)


def test_forward_refuses_ids_outside_the_vocabulary(small_pair):
    with pytest.raises(ValueError, match=r"input_ids .* vocabulary \[0, 160\)"):
        forward(small_pair.ours, jnp.asarray([[3, 200]]))
    with pytest.raises(ValueError, match="vocabulary"):
        small_pair.ours(jnp.asarray([[-2, 3]]))


def _run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="aristax")
    models_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--ids", "1", "--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
    (["--ids", "1", "--temperature", "-1"], r"--temperature=-1.0 must be >= 0"),
    # NaN passed `< 0` and decoded greedily
    (["--ids", "1", "--temperature", "nan"], r"--temperature=nan must be >= 0"),
    (["--ids", "1", "--top-p", "1.5"], r"--top-p=1.5 must be in \(0, 1\]"),
    (["--ids", "1", "--top-k", "-2"], r"--top-k=-2 must be >= 0"),
    (["--ids", "1", "--dtype", "foo"], "--dtype='foo' is invalid"),
    (["--ids", "1", "999"], r"outside this model's vocabulary \[0, 160\)"),
    # past int32: a traceback (OverflowError) before
    (["--ids", "1", "4294967301"], r"4294967301, outside this model's vocabulary"),
    (["--text", "w1"], "--text needs .*tokenizer.json"),
    (["--ids", "1", "--eos-token-id", "999"],  # never produced: it would never stop
     r"eos_token_id 999 is outside this model's vocabulary \[0, 160\)"),
])
def test_cli_generate_errors_exit_2(small_pair, capsys, argv, match):
    """The handler raises; ``aristax.cli.main`` prints one line and returns 2."""
    assert cli.main(["generate", str(small_pair.path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aristax generate: ") and re.search(match, err), err
    assert err.count("\n") == 1


def test_cli_generate_without_a_checkpoint_exits_2(tmp_path):
    """Also through ``python -m aristax``."""
    run = subprocess.run([sys.executable, "-m", "aristax", "generate", str(tmp_path / "none"),
                          "--ids", "1"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "has no config.json" in run.stderr and "Traceback" not in run.stderr


def test_cli_generate_with_ids(small_pair, capsys):
    ids = [5, 17, 42, 9]
    out = json.loads(_run_cli([str(small_pair.path), "--ids", *map(str, ids),
                               "--max-new-tokens", "6", "--eos-token-id", "-1", "--json"],
                              capsys))
    expected = generate(small_pair.ours, np.asarray([ids]), 6)[0, len(ids):].tolist()
    assert out["new_ids"] == expected
    assert out["decode_tokens_per_s"] > 0


def test_cli_generate_stopped_at_the_first_token_reports_no_rate(small_pair, capsys):
    """EOS as the first new token: no decode step is timed, and the line says so
    instead of "None tokens/s"."""
    ids = [5, 17, 42, 9]
    first = int(generate(small_pair.ours, np.asarray([ids]), 1)[0, len(ids)])
    out = _run_cli([str(small_pair.path), "--ids", *map(str, ids), "--max-new-tokens", "6",
                    "--eos-token-id", str(first)], capsys)
    assert f"new tokens: {first}\n" in out
    assert "no later decode step to time" in out and "None" not in out


def test_cli_generate_with_text(small_pair, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(small_pair.hf.config.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    for f in small_pair.path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tok.save(str(tmp_path / "tokenizer.json"))
    text = _run_cli([str(tmp_path), "--text", "w5 w17 w42 w9", "--max-new-tokens", "6",
                     "--eos-token-id", "-1"], capsys)
    expected = generate(small_pair.ours, np.asarray([[5, 17, 42, 9]]), 6)[0, 4:].tolist()
    assert f"new tokens: {' '.join(map(str, expected))}" in text
    assert "tokens/s" in text and "text: w" in text


@pytest.mark.parametrize("top_k", [1, 3, 11, 12, 40])
def test_top_k_mask_matches_hf_warper(top_k):
    """Ties at the k-th value are kept, as HF keeps them; k >= V keeps every token."""
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(top_k)).round()
    ref = transformers.generation.TopKLogitsWarper(top_k)(None, logits.clone()).numpy()
    ours = np.asarray(gen_lib.top_k_mask(jnp.asarray(logits.numpy()), jnp.int32(top_k)))
    np.testing.assert_array_equal(ours, ref)


def test_sampling_applies_temperature_top_k_then_top_p_like_hf():
    """HF's warpers in HF's order (temperature, top-k, top-p): 2000 draws per row lie
    where HF's warped distribution is positive, at its frequencies; top-k 0 is off."""
    temperature, top_k, top_p, n = 0.8, 4, 0.9, 2000
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(8)) * 0.5
    warped = logits.clone()
    for warper in (transformers.generation.TemperatureLogitsWarper(temperature),
                   transformers.generation.TopKLogitsWarper(top_k),
                   transformers.generation.TopPLogitsWarper(top_p)):
        warped = warper(None, warped)
    ref = torch.softmax(warped, -1).numpy()
    assert ((ref > 0).sum(-1) > 1).all() and ((ref > 0).sum(-1) <= top_k).all()
    keys = jax.random.split(jax.random.key(1), n)
    for k, want in ((top_k, ref), (0, None)):
        draws = np.asarray(jax.vmap(lambda key: gen_lib.next_token(
            jnp.asarray(logits.numpy()), key, jnp.float32(temperature), jnp.int32(k),
            jnp.float32(top_p), True))(keys))  # [n, 3]
        for row in range(3):
            freq = np.bincount(draws[:, row], minlength=12) / n
            if want is not None:
                assert (want[row, draws[:, row]] > 0).all(), "sampled outside HF's top-k"
                np.testing.assert_allclose(freq, want[row], atol=0.05)
            else:  # top-k off: more tokens than k are drawn
                assert (freq > 0).sum() > top_k


def test_generate_is_exported():
    assert generate is gen_lib.generate


def test_sampling_applies_temperature_before_top_p_like_hf():
    """temperature 0.5, top_p 0.6: 2000 draws per row lie in the nucleus of HF's
    TemperatureLogitsWarper then TopPLogitsWarper, at its renormalized frequencies
    (top-p at temperature 1 keeps more tokens: guarded below)."""
    temperature, top_p, n = 0.5, 0.6, 2000
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(7)) * 0.8
    warped = transformers.generation.TopPLogitsWarper(top_p)(
        None, transformers.generation.TemperatureLogitsWarper(temperature)(None, logits.clone()))
    ref = torch.softmax(warped, -1).numpy()
    untempered = transformers.generation.TopPLogitsWarper(top_p)(None, logits.clone())
    # the order matters in every row, and each row samples among several tokens
    assert (np.isfinite(untempered.numpy()).sum(-1) > (ref > 0).sum(-1)).all()
    assert ((ref > 0).sum(-1) > 1).all()
    keys = jax.random.split(jax.random.key(0), n)
    draws = np.asarray(jax.vmap(lambda k: gen_lib.next_token(
        jnp.asarray(logits.numpy()), k, jnp.float32(temperature), jnp.int32(0),
        jnp.float32(top_p),
        True))(keys))  # [n, 3]
    for row in range(3):
        assert (ref[row, draws[:, row]] > 0).all(), "sampled outside HF's nucleus"
        freq = np.bincount(draws[:, row], minlength=12) / n
        np.testing.assert_allclose(freq, ref[row], atol=0.05)
