"""aristax Qwen3Moe against transformers.Qwen3MoeForCausalLM (float32, eager attention,
tiny random models built here): logits, router logits and aux loss (plain and
left-padded), 32 greedy tokens (one prompt and a left-padded batch), checkpoints both
ways, config.json mapping and its refusals, and ``aristax generate`` on a saved
directory. The two cases cover decoder_sparse_step 2 with mlp_only_layers,
norm_topk_prob True and False, attention biases, a sliding window, MQA with an explicit
head_dim and tied embeddings."""

from __future__ import annotations

import argparse
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from mixtral_cases import Pair, hf_logits, left_padded, randomize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file as torch_save_file  # noqa: E402

from aristax import cli  # noqa: E402
from aristax.models import (  # noqa: E402
    Mixtral,
    Qwen3Moe,
    Qwen3MoeConfig,
    forward,
    generate,
)
from aristax.models import cli as models_cli  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5  # as test_mixtral_parity
PROMPT, NEW = 9, 32
B, S = 3, 13  # one forward shape for every test: one compile per model

BASE = dict(vocab_size=160, hidden_size=32, intermediate_size=56, moe_intermediate_size=24,
            num_attention_heads=4, max_position_embeddings=256, rope_theta=10000.0,
            bos_token_id=1, eos_token_id=None, pad_token_id=None)  # no EOS: full length

CASES = {
    # layers 0, 2 dense by the step, 3 by mlp_only_layers: one MoE layer (1); top-2 of
    # 4 renormalised; GQA 4 on 2; q/k/v/o biases; window 6 < the prompt lengths
    "step2_mlponly_norm_bias_window": dict(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, num_key_value_heads=2,
        attention_bias=True, use_sliding_window=True, sliding_window=6),
    # layer 1 dense (mlp_only_layers), 0 and 2 MoE (the aux loss pools both); top-2 of 6
    # not renormalised; one KV head, head_dim 12 != 32 / 4; tied embeddings
    "mlponly_unnormed_mqa_tied": dict(
        num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[1], num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False, num_key_value_heads=1, head_dim=12,
        tie_word_embeddings=True),
}


def make_hf(overrides: dict, seed: int = 0):
    kwargs = {**BASE, **overrides}
    theta = kwargs.pop("rope_theta")
    cfg = transformers.Qwen3MoeConfig(
        **kwargs, rope_parameters={"rope_type": "default", "rope_theta": theta},
        attn_implementation="eager")
    torch.manual_seed(seed)
    return randomize(transformers.Qwen3MoeForCausalLM(cfg).eval())


@pytest.fixture(scope="module", params=sorted(CASES))
def qpair(request, tmp_path_factory) -> Pair:
    """A tiny HF model, saved by transformers, and aristax's load of that directory."""
    hf = make_hf(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return Pair(request.param, hf, Qwen3Moe.from_pretrained(path), path)


def _sparse_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if layer.moe is not None]


def hf_generate(hf, ids, mask=None):
    with torch.no_grad():
        return hf.generate(torch.as_tensor(ids), attention_mask=None if mask is None
                           else torch.as_tensor(mask), max_new_tokens=NEW,
                           do_sample=False).numpy()


# --------------------------------------------------------------------- parity
def test_sparse_and_dense_layers_are_hf_s():
    """Which layers hold a MoE block: HF's rule, on a config mixing both settings."""
    cfg = dict(num_hidden_layers=7, decoder_sparse_step=2, mlp_only_layers=[3, 6],
               num_experts=2, num_experts_per_tok=1)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**BASE, **cfg}))
    theirs = [i for i, layer in enumerate(hf.model.layers)
              if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"]
    ours = Qwen3MoeConfig.from_hf(hf.config.to_dict())
    assert theirs == [1, 5]
    assert [i for i in range(7) if ours.layer_is_sparse(i)] == theirs


def test_logits_router_logits_and_aux_loss_match_hf(qpair):
    ours, theirs = qpair.ours.config, qpair.hf.config
    assert (ours.sliding_window, ours.norm_topk_prob, ours.attention_bias, ours.head_dim) == (
        theirs.sliding_window, theirs.norm_topk_prob, theirs.attention_bias,
        qpair.hf.model.layers[0].self_attn.head_dim)
    ids = np.random.default_rng(0).integers(0, qpair.hf.config.vocab_size, size=(B, S))
    ref = hf_logits(qpair.hf, ids, output_router_logits=True)
    out = forward(qpair.ours, jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-6)
    # one per MoE layer, as HF records them
    assert len(out.router_logits) == len(ref.router_logits) == len(_sparse_layers(qpair.ours))
    for ours_l, hf_l in zip(out.router_logits, ref.router_logits, strict=True):
        np.testing.assert_allclose(np.asarray(ours_l).reshape(hf_l.shape), hf_l.numpy(),
                                   rtol=RTOL, atol=ATOL)
    assert [a is None for a in out.moe_aux] == [layer.moe is None
                                                for layer in qpair.ours.layers]


def test_padded_logits_and_aux_loss_match_hf(qpair):
    ids, mask = left_padded(np.random.default_rng(1), [S, 8, 3], S, qpair.hf.config.vocab_size)
    ref = hf_logits(qpair.hf, ids, mask, output_router_logits=True)
    out = forward(qpair.ours, jnp.asarray(ids), jnp.asarray(mask))
    real = mask == 1  # the logits of padding queries are meaningless in both
    np.testing.assert_allclose(np.asarray(out.logits)[real], ref.logits.numpy()[real],
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-6)


def test_greedy_generation_matches_hf(qpair):
    """32 tokens after one prompt (no attention mask)."""
    ids = np.random.default_rng(3).integers(3, qpair.hf.config.vocab_size, size=(1, PROMPT))
    np.testing.assert_array_equal(generate(qpair.ours, ids, NEW), hf_generate(qpair.hf, ids))


def test_left_padded_batch_generation_matches_hf(qpair):
    ids, mask = left_padded(np.random.default_rng(4), [PROMPT, 5, 1], PROMPT,
                            qpair.hf.config.vocab_size)
    ours = generate(qpair.ours, ids, NEW, attention_mask=mask)
    ref = hf_generate(qpair.hf, ids, mask)
    assert ours.shape == ref.shape == (3, PROMPT + NEW)
    np.testing.assert_array_equal(ours, ref)


# --------------------------------------------------------------------- checkpoints
def test_saved_checkpoint_loads_in_hf(qpair, tmp_path):
    """aristax -> HF (and back): the same logits; sharded the same."""
    qpair.ours.save_pretrained(tmp_path, max_shard_bytes=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    ids = np.random.default_rng(6).integers(0, qpair.hf.config.vocab_size, size=(B, S))
    np.testing.assert_array_equal(hf_logits(reloaded, ids).logits.numpy(),
                                  hf_logits(qpair.hf, ids).logits.numpy())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    ours_again = Qwen3Moe.from_pretrained(tmp_path)
    np.testing.assert_array_equal(np.asarray(forward(ours_again, jnp.asarray(ids)).logits),
                                  np.asarray(forward(qpair.ours, jnp.asarray(ids)).logits))


def test_reads_fused_expert_layout(qpair, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2F, D],
    down_proj [E, D, F]) saved as is loads too."""
    state = {k: v.contiguous() for k, v in qpair.hf.state_dict().items()
             if not (qpair.hf.config.tie_word_embeddings and k == "lm_head.weight")}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    torch_save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(qpair.path / "config.json", tmp_path / "config.json")
    ids = np.random.default_rng(7).integers(0, qpair.hf.config.vocab_size, size=(B, S))
    np.testing.assert_array_equal(
        np.asarray(forward(Qwen3Moe.from_pretrained(tmp_path), jnp.asarray(ids)).logits),
        np.asarray(forward(qpair.ours, jnp.asarray(ids)).logits))


@pytest.mark.parametrize("qpair", ["mlponly_unnormed_mqa_tied"], indirect=True)
def test_each_model_refuses_the_other_s_checkpoint(qpair):
    with pytest.raises(ValueError, match="model_type='qwen3_moe'; Mixtral needs 'mixtral'"):
        Mixtral.from_pretrained(qpair.path)


# --------------------------------------------------------------------- config
def test_config_round_trips_through_transformers():
    cfg = Qwen3MoeConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                         moe_intermediate_size=40, num_hidden_layers=5,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2,
                         mlp_only_layers=(4, 0), norm_topk_prob=True, attention_bias=True,
                         sliding_window=16, rope_theta=5e5, tie_word_embeddings=True,
                         router_aux_loss_coef=0.02, output_router_logits=True,
                         eos_token_id=(2, 7))
    assert cfg.mlp_only_layers == (0, 4)
    hf = transformers.Qwen3MoeConfig(**cfg.to_hf())
    assert hf.num_experts == 6 and hf.moe_intermediate_size == 40 and hf.head_dim == 16
    assert hf.sliding_window == 16 and hf.rope_parameters["rope_theta"] == 5e5
    assert hf.mlp_only_layers == [0, 4] and hf.norm_topk_prob and hf.attention_bias
    assert Qwen3MoeConfig.from_hf(hf.to_dict()) == cfg
    assert Qwen3MoeConfig.from_hf(cfg.replace(sliding_window=None).to_hf()).sliding_window \
        is None


def test_config_reads_transformers_4_config_json():
    """Published Qwen3-MoE config.json files: num_experts, a top-level rope_theta, a
    sliding_window that use_sliding_window false switches off, keys HF ignores."""
    cfg = Qwen3MoeConfig.from_hf({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
        "rope_scaling": None, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 48, "mlp_only_layers": [], "torch_dtype": "bfloat16"})
    assert (cfg.num_experts, cfg.head_dim, cfg.rope_theta) == (8, 32, 1e6)
    assert cfg.sliding_window is None and cfg.mlp_only_layers == ()
    assert cfg.dtype == "float32"  # the checkpoint's storage dtype is not ours
    assert Qwen3MoeConfig.from_hf({"use_sliding_window": True}).sliding_window == 4096


@pytest.mark.parametrize("hf, match", [
    ({"model_type": "mixtral"}, "model_type='mixtral'; Qwen3-MoE needs 'qwen3_moe'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_type='yarn'"),
    ({"num_experts": 0}, r"Qwen3MoeConfig.num_experts=0 is invalid"),
    ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"moe_intermediate_size": -1}, "moe_intermediate_size=-1"),
    ({"mlp_only_layers": [0, "1"]}, r"mlp_only_layers=\[0, '1'\]"),
    ({"mlp_only_layers": [-1]}, r"mlp_only_layers=\[-1\]"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    ({"attention_bias": 1}, "attention_bias=1"),
    ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window=0"),
])
def test_config_rejects_unsupported(hf, match):
    with pytest.raises(ValueError, match=match):
        Qwen3MoeConfig.from_hf(hf)


# --------------------------------------------------------------------- CLI
@pytest.mark.parametrize("qpair", ["mlponly_unnormed_mqa_tied"], indirect=True)
def test_cli_generate_on_a_saved_qwen3_moe_checkpoint(qpair, tmp_path, capsys):
    """``aristax generate`` picks Qwen3Moe by config.json's model_type."""
    qpair.ours.save_pretrained(tmp_path)
    parser = argparse.ArgumentParser(prog="aristax")
    models_cli.register(parser.add_subparsers(dest="command", required=True))
    ids = [5, 17, 42, 9]
    args = parser.parse_args(["generate", str(tmp_path), "--ids", *map(str, ids),
                              "--max-new-tokens", "6", "--eos-token-id", "-1"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    expected = generate(qpair.ours, np.asarray([ids]), 6)[0, len(ids):].tolist()
    assert f"new tokens: {' '.join(map(str, expected))}" in text and "tokens/s" in text


@pytest.mark.parametrize("qpair", ["mlponly_unnormed_mqa_tied"], indirect=True)
def test_cli_generate_unknown_model_type_is_one_line(qpair, tmp_path, capsys):
    shutil.copytree(qpair.path, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config,
                                                               "model_type": "llama"}))
    assert cli.main(["generate", str(tmp_path / "ckpt"), "--ids", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aristax generate: ") and err.count("\n") == 1, err
    assert "model_type='llama'" in err and "'qwen3_moe'" in err, err
