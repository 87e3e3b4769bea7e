"""aristax Mixtral against transformers.MixtralForCausalLM: logits, aux loss, greedy
generation (single prompt and left-padded batch), EOS handling, checkpoint round trip."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from mixtral_cases import hf_logits, left_padded

from aristax import routing
from aristax.models import Mixtral, MixtralConfig, forward, generate, sparse_moe
from aristax.models.mixtral import rope_cos_sin

RTOL, ATOL = 1e-4, 1e-5
PROMPT, NEW = 9, 32
B, S = 3, 13  # one forward shape for every test: one compile per model


def test_logits_and_aux_loss_match_hf(pair):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, pair.hf.config.vocab_size, size=(B, S))
    ref = hf_logits(pair.hf, ids, output_router_logits=True)
    out = forward(pair.ours, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-6)
    for ours_l, hf_l in zip(out.router_logits, ref.router_logits, strict=True):
        np.testing.assert_allclose(np.asarray(ours_l).reshape(hf_l.shape), hf_l.numpy(),
                                   rtol=RTOL, atol=ATOL)


def test_padded_logits_and_aux_loss_match_hf(pair):
    ids, mask = left_padded(np.random.default_rng(1), [S, 8, 3], S, pair.hf.config.vocab_size)
    ref = hf_logits(pair.hf, ids, mask, output_router_logits=True)
    out = forward(pair.ours, jnp.asarray(ids), jnp.asarray(mask))
    real = mask.astype(bool)  # padding queries are meaningless in both
    np.testing.assert_allclose(np.asarray(out.logits)[real], ref.logits.numpy()[real],
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-6)
    # the mask must matter: without it the aux loss differs
    unmasked = float(forward(pair.ours, jnp.asarray(ids)).aux_loss)
    assert abs(unmasked - float(ref.aux_loss)) > 1e-6


@pytest.mark.parametrize("head_dim,theta", [(128, 1e6), (128, 1e4), (64, 1e4), (16, 37.0),
                                            (96, 123456.7)])
def test_rotary_cos_sin_match_hf_at_long_positions(head_dim, theta):
    """A frequency one float32 rounding step off moves cos/sin by ~1e-3 near 32k."""
    hf_cfg = transformers.MixtralConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                        head_dim=head_dim, rope_theta=theta)
    rotary = transformers.models.mixtral.modeling_mixtral.MixtralRotaryEmbedding(hf_cfg)
    positions = np.array([[0, 1, 100, 4095, 8191, 32767, 65535, 131071]])
    cos, sin = rotary(torch.zeros(1, positions.shape[1], head_dim), torch.tensor(positions))
    ours = rope_cos_sin(jnp.asarray(positions, jnp.int32), head_dim, theta, jnp.float32)
    np.testing.assert_allclose(np.asarray(ours[0]), cos.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ours[1]), sin.numpy(), rtol=0, atol=1e-5)


def test_sliding_window_matters(small_pair):
    """Guard against a vacuous window test: the window changes the logits."""
    window = small_pair.hf.config.sliding_window
    assert window is not None and window < S
    ids = np.random.default_rng(2).integers(0, small_pair.hf.config.vocab_size, size=(B, S))
    no_window = nnx.merge(*nnx.split(small_pair.ours))  # a copy sharing the weights
    for layer in no_window.layers:
        layer.attn.sliding_window = None
    a = np.asarray(forward(small_pair.ours, jnp.asarray(ids)).logits)
    b = np.asarray(forward(no_window, jnp.asarray(ids)).logits)
    # two compiled programs: equal up to float32 rounding (seen: 1e-6 on 1 logit)
    np.testing.assert_allclose(a[:, :window], b[:, :window], rtol=1e-5, atol=1e-5)
    assert np.abs(a - b)[:, window:].max() > 1e-3


def hf_generate(hf, ids, mask=None, **kw):
    with torch.no_grad():
        return hf.generate(torch.as_tensor(ids), attention_mask=None if mask is None
                           else torch.as_tensor(mask), max_new_tokens=NEW, do_sample=False,
                           **kw).numpy()


def test_greedy_generation_matches_hf(small_pair):
    """One prompt, no attention mask (the batched cases below cover every model)."""
    ids = np.random.default_rng(3).integers(3, small_pair.hf.config.vocab_size, size=(1, PROMPT))
    ours = generate(small_pair.ours, ids, NEW)
    np.testing.assert_array_equal(ours, hf_generate(small_pair.hf, ids))


def test_left_padded_batch_generation_matches_hf(pair):
    ids, mask = left_padded(np.random.default_rng(4), [PROMPT, 5, 1], PROMPT,
                            pair.hf.config.vocab_size)
    ours = generate(pair.ours, ids, NEW, attention_mask=mask)
    ref = hf_generate(pair.hf, ids, mask)
    assert ours.shape == ref.shape == (3, PROMPT + NEW)
    np.testing.assert_array_equal(ours, ref)


def test_eos_stops_rows_like_hf(small_pair):
    ids, mask = left_padded(np.random.default_rng(4), [PROMPT, 5, 1], PROMPT,
                            small_pair.hf.config.vocab_size)
    free = hf_generate(small_pair.hf, ids, mask)
    eos = int(free[0, PROMPT + 3])  # row 0 ends after 4 tokens; others may run on
    ref = hf_generate(small_pair.hf, ids, mask, eos_token_id=eos, pad_token_id=0)
    ours = generate(small_pair.ours, ids, NEW, attention_mask=mask, eos_token_id=eos,
                    pad_token_id=0)
    np.testing.assert_array_equal(ours, ref)
    assert (ours[0, PROMPT + 4:] == 0).all()


def test_default_eos_pad_and_inferred_mask_follow_the_config_like_hf(small_pair, tmp_path):
    """Given no EOS, pad or mask, both read the checkpoint config's EOS and pad ids and
    infer the mask of left-padded prompts from the pad id (HF's rule)."""
    ids, mask = left_padded(np.random.default_rng(4), [PROMPT, 5, 1], PROMPT,
                            small_pair.hf.config.vocab_size)  # pad id 0
    eos = int(hf_generate(small_pair.hf, ids, mask)[0, PROMPT + 3])
    assert eos != 0  # else the pad id would be an EOS id and no mask inferred
    small_pair.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()  # HF then reads config.json's ids
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": eos,
                                                      "pad_token_id": 0}))
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    with torch.no_grad():
        ref = hf.eval().generate(torch.as_tensor(ids), max_new_tokens=NEW,
                                 do_sample=False).numpy()
    ours = generate(Mixtral.from_pretrained(tmp_path), ids, NEW)
    np.testing.assert_array_equal(ours, ref)
    explicit = generate(small_pair.ours, ids, NEW, attention_mask=mask, eos_token_id=eos,
                        pad_token_id=0)
    np.testing.assert_array_equal(ours, explicit)
    assert (ours[0, PROMPT + 4:] == 0).all()


def test_generation_config_json_sets_eos_and_sampling_like_hf(small_pair, tmp_path):
    """A checkpoint's generation_config.json lists an EOS id that config.json does not
    (as instruct checkpoints do): both stop there with no argument given (aristax read
    config.json's only: a user trial's 12 tokens against HF's 3). Its sampling
    settings are the defaults: generate(model, ids, N) samples as they say."""
    ids = np.random.default_rng(5).integers(3, 100, size=(1, PROMPT))
    free = hf_generate(small_pair.hf, ids)[0, PROMPT:]
    extra = int(free[2])
    never = next(t for t in range(3, 100) if t not in free)
    assert small_pair.hf.config.eos_token_id is None
    small_pair.hf.save_pretrained(tmp_path)
    gen_file = tmp_path / "generation_config.json"
    gen = {k: v for k, v in json.loads(gen_file.read_text()).items()
           if k != "_from_model_config"}  # a file of its own, as instruct checkpoints ship
    gen_file.write_text(json.dumps({**gen, "eos_token_id": [never, extra]}))
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    with torch.no_grad():
        ref = hf.eval().generate(torch.as_tensor(ids), max_new_tokens=NEW).numpy()
    assert ref.shape[1] == PROMPT + 1 + list(free).index(extra)  # HF stopped there
    model = Mixtral.from_pretrained(tmp_path)
    np.testing.assert_array_equal(generate(model, ids, NEW), ref)

    gen_file.write_text(json.dumps({**gen, "do_sample": True, "temperature": 1.7,
                                    "top_k": 7, "top_p": 0.9}))
    model = Mixtral.from_pretrained(tmp_path)
    rng = jax.random.key(4)
    sampled = generate(model, ids, NEW, rng=rng)
    np.testing.assert_array_equal(sampled, generate(model, ids, NEW, rng=rng, temperature=1.7,
                                                    top_k=7, top_p=0.9))
    assert (sampled != generate(model, ids, NEW, temperature=0.0)).any()


def test_generation_config_round_trips_through_hf(small_pair, tmp_path):
    """save_pretrained writes the model's generation config; HF and aristax read the
    same settings back."""
    from aristax.models.generation_config import GenerationConfig

    model = Mixtral.from_pretrained(small_pair.path)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_k=20,
                                               top_p=0.95, eos_token_id=(2, 7), pad_token_id=0)
    model.save_pretrained(tmp_path)
    hf = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert (hf.do_sample, hf.temperature, hf.top_k, hf.top_p, hf.eos_token_id,
            hf.pad_token_id) == (True, 0.6, 20, 0.95, [2, 7], 0)
    assert Mixtral.from_pretrained(tmp_path).generation_config == model.generation_config


@pytest.mark.parametrize("entry, error", [
    ({"repetition_penalty": 1.2}, None), ({"num_beams": 4}, None),
    # HF 5 applies these too (TopHLogitsWarper, stopping criteria); a user trial found
    # them loaded without the warning
    ({"top_h": 0.5}, None), ({"max_time": 1.0}, None), ({"stop_strings": ["w1"]}, None),
    ({"pad_token_id": 999}, "pad_token_id 999 (the model's generation config or "
                            "config.json) is outside this model's vocabulary [0, 160)"),
    ({"temperature": "hot"}, "temperature='hot' must be a JSON number"),
    ({"do_sample": "false"}, "do_sample='false' must be a JSON boolean"),
    ({"eos_token_id": [2, 1.5]}, "eos_token_id=1.5"),
    ({"eos_token_id": 999}, "eos_token_id 999 (the model's generation config or config.json)"
                            " is outside this model's vocabulary [0, 160)"),
])
def test_generation_config_settings_not_applied_warn_and_bad_values_are_refused(
        small_pair, tmp_path, entry, error):
    small_pair.hf.save_pretrained(tmp_path)
    gen_file = tmp_path / "generation_config.json"
    gen_file.write_text(json.dumps({**json.loads(gen_file.read_text()), **entry}))
    if error is None:
        with pytest.warns(UserWarning, match=re.escape(f"sets {entry}") + ".*does not apply"):
            Mixtral.from_pretrained(tmp_path)
    else:  # at load, or (an EOS id) at generate
        with pytest.raises(ValueError, match=re.escape(error)):
            generate(Mixtral.from_pretrained(tmp_path), np.ones((1, 3), np.int32), 2)


def test_router_jitter_noise_reaches_router_and_experts(monkeypatch):
    """HF's MixtralSparseMoeBlock multiplies its whole input by the noise in training,
    so the experts see it too. With the noise fixed at 1 + eps that equals the eval
    model with the post-attention norm weights times 1 + eps."""
    eps = 0.25
    monkeypatch.setattr(routing, "apply_jitter", lambda x, eps, rng: x * (1 + eps))
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=eps)
    model = Mixtral(cfg, rngs=nnx.Rngs(params=0, dropout=1))  # no "default" stream
    ids = jnp.asarray(np.random.default_rng(9).integers(0, 64, size=(2, 7)))
    model.eval()
    eval_logits = model(ids).logits
    model.train()
    train_logits = model(ids).logits
    model.eval()
    for layer in model.layers:
        layer.post_attention_norm.weight_d.set_value(layer.post_attention_norm.weight_d[...]
                                                     * (1 + eps))
    np.testing.assert_allclose(np.asarray(train_logits), np.asarray(model(ids).logits),
                               rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(train_logits) - np.asarray(eval_logits)).max() > 1e-3


@pytest.mark.parametrize("batch, seq", [(B, S), (3, 30)])
def test_decode_weights_path_matches_module_path_and_hf(small_pair, batch, seq):
    """With decode weights every projection reads the [out, in] copies and the MoE
    blocks run sparse_moe (on CPU at any size; both sizes here group rows by expert,
    the decode steps of the generate tests run each selected expert on all rows).
    They equal Hugging Face and the aristax.MoE path. (On a GPU, 39 tokens run each
    selected expert on all rows, and 90 take the module path: skipped there.)"""
    if not sparse_moe.use_decode_weights(batch * seq):
        pytest.skip(f"{batch * seq} tokens take the module path on this platform")
    if jax.default_backend() == "cpu":
        assert batch * seq > sparse_moe.max_selected_tokens()
    lengths = [seq, seq // 2, 3]
    ids, mask = left_padded(np.random.default_rng(5), lengths, seq,
                            small_pair.hf.config.vocab_size)
    model, ids, mask = small_pair.ours, jnp.asarray(ids), jnp.asarray(mask)
    dense = forward(model, ids, mask)
    sparse = forward(model, ids, mask, decode_weights=model.decode_weights())
    np.testing.assert_allclose(np.asarray(sparse.logits), np.asarray(dense.logits),
                               rtol=RTOL, atol=ATOL)  # GEMV sum order differs
    ref = hf_logits(small_pair.hf, np.asarray(ids), np.asarray(mask))
    real = np.asarray(mask).astype(bool)
    np.testing.assert_allclose(np.asarray(sparse.logits)[real], ref.logits.numpy()[real],
                               rtol=RTOL, atol=ATOL)


def test_decode_weights_keep_moe_configs_sparse_moe_cannot_compute(small_pair):
    """A DeepSeek-style block (shared expert, capacity) is outside sparse_moe: the decode
    weights then carry no experts and the layer runs aristax.MoE, so generation equals
    the module path instead of silently dropping the shared expert."""
    cfg = small_pair.ours.config
    moe = cfg.moe_config().replace(num_shared_experts=1, capacity_factor=2.0)
    assert not sparse_moe.supports(moe)
    model = Mixtral(cfg, rngs=nnx.Rngs(0), moe_config=moe)
    weights = model.decode_weights()
    assert all(layer.experts is None for layer in weights.layers)
    ids = jnp.asarray(np.random.default_rng(8).integers(0, cfg.vocab_size, size=(B, S)))
    np.testing.assert_allclose(
        np.asarray(forward(model, ids, decode_weights=weights).logits),
        np.asarray(forward(model, ids).logits), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shard", [False, True])
def test_saved_checkpoint_loads_in_hf(pair, tmp_path, shard):
    pair.ours.save_pretrained(tmp_path, max_shard_bytes=20_000 if shard else None)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    reloaded = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    ids = np.random.default_rng(6).integers(0, pair.hf.config.vocab_size, size=(B, S))
    np.testing.assert_array_equal(hf_logits(reloaded, ids).logits.numpy(),
                                  hf_logits(pair.hf, ids).logits.numpy())
    ours_again = Mixtral.from_pretrained(tmp_path)
    np.testing.assert_array_equal(np.asarray(forward(ours_again, jnp.asarray(ids)).logits),
                                  np.asarray(forward(pair.ours, jnp.asarray(ids)).logits))


@pytest.mark.parametrize("top_k, with_mask", [(1, False), (2, True), (3, True)])
def test_load_balancing_loss_matches_hf_function(top_k, with_mask):
    """The pure loss against HF's load_balancing_loss_func on 3 layers of logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from aristax.models.mixtral import load_balancing_loss

    gen = torch.Generator().manual_seed(top_k)
    layers = tuple(torch.randn(4 * 7, 6, generator=gen) * 2 for _ in range(3))
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[1, :3] = mask[3, :6] = 0
    ref = load_balancing_loss_func(layers, 6, top_k, mask if with_mask else None)
    ours = load_balancing_loss([jnp.asarray(x.numpy()) for x in layers], 6, top_k,
                               jnp.asarray(mask.numpy()) if with_mask else None)
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)


def test_cached_multi_token_call_without_position_ids_matches_full_forward(small_pair):
    """Prefill 5 tokens into a KVCache, then feed 3 more in one call with no
    position_ids: positions default to ``cache.index + arange(S)`` (5, 6, 7), so the
    logits equal the uncached forward of all 8 tokens (and Hugging Face's)."""
    from aristax.models.mixtral import KVCache
    model = small_pair.ours
    ids = np.random.default_rng(11).integers(0, model.config.vocab_size, size=(2, 8))
    graphdef, state = nnx.split(model)

    @jax.jit  # one program per call shape (op-by-op eager calls take ~25 s)
    def cached(state, ids, cache):
        out = nnx.merge(graphdef, state)(ids, cache=cache)
        return out.logits, out.cache

    first, cache = cached(state, jnp.asarray(ids[:, :5]), KVCache.init(model.config, 2, 8))
    second, cache = cached(state, jnp.asarray(ids[:, 5:]), cache)
    assert int(cache.index) == 8
    got = np.concatenate([np.asarray(first), np.asarray(second)], axis=1)
    np.testing.assert_allclose(got, np.asarray(forward(model, jnp.asarray(ids)).logits),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, hf_logits(small_pair.hf, ids).logits.numpy(),
                               rtol=RTOL, atol=ATOL)
