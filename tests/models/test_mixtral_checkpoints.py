"""Reading Hugging Face checkpoints in both expert layouts, sharded or not, and the
errors for missing or mis-shaped tensors; MixtralConfig <-> config.json; a model that
carries out a placement plan reads and writes experts in logical order."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from mixtral_cases import CASES, hf_logits, make_hf
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as torch_save_file

from aristax.models import Mixtral, MixtralConfig, forward, generate
from aristax.models.hf import CheckpointError
from aristax.parallel import mesh_from_plan
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import uniform

B, S = 3, 13  # the forward shape of test_mixtral_parity: compiled once per model


def _ids(pair):
    return np.random.default_rng(7).integers(0, pair.hf.config.vocab_size, size=(B, S))


def _assert_same_logits(model, pair):
    ids = _ids(pair)
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids)).logits),
                               hf_logits(pair.hf, ids).logits.numpy(), rtol=1e-4, atol=1e-5)


def test_reads_hf_sharded_checkpoint(small_pair, tmp_path):
    small_pair.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    _assert_same_logits(Mixtral.from_pretrained(tmp_path), small_pair)


def test_reads_fused_expert_layout(small_pair, tmp_path):
    """transformers 5 holds experts fused in memory (mlp.experts.gate_up_proj [E,2F,D],
    down_proj [E,D,F]); a state_dict saved as is must load too."""
    state = {k: v.contiguous() for k, v in small_pair.hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    torch_save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(small_pair.path / "config.json", tmp_path / "config.json")
    _assert_same_logits(Mixtral.from_pretrained(tmp_path), small_pair)
    # and transformers reads that layout back as well
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    np.testing.assert_array_equal(hf_logits(hf.eval(), _ids(small_pair)).logits.numpy(),
                                  hf_logits(small_pair.hf, _ids(small_pair)).logits.numpy())


def _edit_checkpoint(src, dst, edit):
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(small_pair, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    _edit_checkpoint(small_pair.path, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensor .*experts\.3\.w2\.weight.*"
                                              r"expected shape \(32, 48\)"):
        Mixtral.from_pretrained(tmp_path)


def test_mismatched_tensor_shape_is_named(small_pair, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(t):
        t[name] = np.zeros((8, 32), np.float32)

    _edit_checkpoint(small_pair.path, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*shape \(8, 32\), "
                                              r"expected \(16, 32\)"):
        Mixtral.from_pretrained(tmp_path)


def test_untied_checkpoint_without_lm_head_fails(small_pair, tmp_path):
    _edit_checkpoint(small_pair.path, tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        Mixtral.from_pretrained(tmp_path)


@pytest.mark.parametrize("first_sharded", [True, False])
def test_saving_over_a_checkpoint_replaces_its_weights(small_pair, tmp_path, first_sharded):
    """Another model saved there first, sharded or not, then ours the other way: both
    aristax and transformers read ours (a stale model.safetensors shadows an index)."""
    other = Mixtral(small_pair.ours.config, rngs=nnx.Rngs(3))
    other.save_pretrained(tmp_path, max_shard_bytes=20_000 if first_sharded else None)
    small_pair.ours.save_pretrained(tmp_path, max_shard_bytes=None if first_sharded else 20_000)
    _assert_same_logits(Mixtral.from_pretrained(tmp_path), small_pair)
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    np.testing.assert_array_equal(hf_logits(hf.eval(), _ids(small_pair)).logits.numpy(),
                                  hf_logits(small_pair.hf, _ids(small_pair)).logits.numpy())


@pytest.mark.parametrize("change", [dict(top_k=1), dict(num_shared_experts=1),
                                    dict(router="sigmoid"), dict(capacity_factor=1.0)])
def test_save_refuses_a_moe_block_that_is_not_mixtrals(small_pair, tmp_path, change):
    cfg = small_pair.ours.config
    model = Mixtral(cfg, rngs=nnx.Rngs(0), moe_config=dataclasses.replace(cfg.moe_config(),
                                                                          **change))
    name, value = next(iter(change.items()))
    with pytest.raises(ValueError, match=rf"layer 0's MoE block is not Mixtral's: {name}="
                                         rf"{value!r}"):
        model.save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written
    # how it computes (kernels, chunks) is not part of a checkpoint
    same = Mixtral(cfg, rngs=nnx.Rngs(0), moe_config=dataclasses.replace(
        cfg.moe_config(), implementation="reference", num_chunks=2))
    same.save_pretrained(tmp_path)


def test_missing_config_fails(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Mixtral.from_pretrained(tmp_path)


# --------------------------------------------------------------------- config
def test_config_round_trips_through_transformers():
    cfg = MixtralConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                        num_local_experts=6, num_experts_per_tok=2, sliding_window=16,
                        rope_theta=5e5, tie_word_embeddings=True, eos_token_id=(2, 7))
    hf = transformers.MixtralConfig(**cfg.to_hf())
    assert hf.rope_parameters["rope_theta"] == 5e5
    assert hf.num_local_experts == 6 and hf.head_dim == 8 and hf.sliding_window == 16
    assert MixtralConfig.from_hf(hf.to_dict()) == cfg


def test_config_reads_hf_attribute_aliases():
    """transformers reads config.json's "num_experts" as num_local_experts."""
    assert transformers.MixtralConfig(num_experts=3).num_local_experts == 3
    assert MixtralConfig.from_hf({"num_experts": 3, "num_experts_per_tok": 2}
                                 ).num_local_experts == 3


def test_config_reads_legacy_rope_theta():
    cfg = MixtralConfig.from_hf({"model_type": "mixtral", "rope_theta": 1234.0,
                                 "hidden_size": 32, "num_attention_heads": 4,
                                 "num_key_value_heads": None})
    assert cfg.rope_theta == 1234.0 and cfg.num_key_value_heads == 4 and cfg.head_dim == 8


@pytest.mark.parametrize("scaling, theta", [({"rope_type": "default"}, 500000.0),
                                            ({"type": "default", "rope_theta": 77.0}, 77.0)])
def test_config_reads_a_legacy_default_rope_scaling_as_hf_does(scaling, theta):
    """A 4.x config.json's rope_scaling that asks for plain rotary embeddings is what
    transformers reads it as (it was refused as scaling)."""
    hf = {"model_type": "mixtral", "rope_theta": 500000.0, "rope_scaling": scaling}
    transformers = pytest.importorskip("transformers")
    assert transformers.MixtralConfig(**hf).rope_parameters["rope_theta"] == theta
    assert MixtralConfig.from_hf(hf).rope_theta == theta


@pytest.mark.parametrize("hf, match", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama"}, "model_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"sliding_window": 0}, "sliding_window=0"),
])
def test_config_rejects_unsupported(hf, match):
    with pytest.raises(ValueError, match=match):
        MixtralConfig.from_hf(hf)


def test_config_rejects_float64_without_64_bit_jax():
    """dtype is ours, not config.json's; without x64 JAX would make float32 arrays."""
    with pytest.raises(ValueError, match="dtype='float64'.*64-bit"):
        MixtralConfig.from_hf({}, dtype="float64")


def test_saved_config_is_plain_json(small_pair, tmp_path):
    small_pair.ours.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}


@pytest.mark.cpu_backend
def test_planned_model_loads_and_saves_experts_in_logical_order(tmp_path):
    """A skewed plan stores the 8 experts in physical slots (replicas, empty slots) on
    a 2 x 4 mesh. ``from_pretrained(mesh=, plan=)`` places the checkpoint's logical
    experts; the expert-parallel forward and ``generate`` (its decode weights) equal
    Hugging Face; ``save_pretrained`` writes them back in logical order."""
    hf = make_hf(CASES["top1_e8_mha"])
    hf.save_pretrained(tmp_path / "hf")
    load = tuple(float(v) for v in np.geomspace(1.0, 40.0, 8))
    plan = make_plan(uniform(8), ModelSpec(num_experts=8, expert_load=load, top_k=1),
                     groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    planned = Mixtral.from_pretrained(tmp_path / "hf", mesh=mesh_from_plan(plan), plan=plan)
    slots = planned.layers[0].moe.experts.up_edf[...]
    logical = planned.layers[0].moe.logical_params().up_edf
    assert slots.shape[0] > 8 or not np.array_equal(np.asarray(slots), np.asarray(logical)), \
        "the plan kept the logical order; pick a more skewed load"

    ids = np.random.default_rng(3).integers(3, hf.config.vocab_size, size=(2, 24))
    np.testing.assert_allclose(np.asarray(forward(planned, jnp.asarray(ids)).logits),
                               hf_logits(hf, ids).logits.numpy(), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False)
    np.testing.assert_array_equal(np.asarray(generate(planned, ids, 8)), theirs.numpy())

    planned.save_pretrained(tmp_path / "back")
    saved, original = load_file(tmp_path / "back" / "model.safetensors"), {
        k: v.numpy() for k, v in hf.state_dict().items()}
    for e in range(8):
        name = f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"
        fused = original["model.layers.1.mlp.experts.down_proj"][e]
        np.testing.assert_array_equal(saved[name], fused, err_msg=name)
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back",
                                                           attn_implementation="eager")
    np.testing.assert_array_equal(hf_logits(back.eval(), ids).logits.numpy(),
                                  hf_logits(hf, ids).logits.numpy())
