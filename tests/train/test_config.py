"""Config loading: YAML differences over the typed base, overrides, errors naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_export import dot_precisions
from flax import nnx

from aristax import MoEConfig
from aristax.train import ConfigError, TrainConfig, load_config
from aristax.train.config import MOE_KEYS, ModelConfig, moe_config
from aristax.train.trainer import build_model

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "experiments" / "configs").glob("*.yaml"))


def test_every_shipped_config_loads_and_builds_its_moe_config():
    assert {p.stem for p in CONFIGS} >= {"tiny", "mixtral", "switch", "deepseek",
                                          "aristos_gpt3_350m"}
    for path in CONFIGS:
        cfg = load_config(path)
        assert isinstance(cfg, TrainConfig) and cfg.name == path.stem
        moe_config(cfg.model, cfg.parallel)


def test_file_then_overrides_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\noptim:\n  lr: 0.5\n")
    cfg = load_config(path, ["optim.lr=0.25", "model.capacity_factor=1.5"])
    assert (cfg.steps, cfg.optim.lr, cfg.model.capacity_factor) == (7, 0.25, 1.5)
    assert cfg.model.d_model == TrainConfig().model.d_model  # untouched: the base
    assert cfg.out_dir == f"runs/{cfg.name}"  # interpolation resolved


def test_implementation_is_a_name_or_an_ordered_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  implementation: [mosaic_gpu, triton]\n")
    assert moe_config(load_config(path).model).implementation == ("mosaic_gpu", "triton")
    cfg = load_config(None, ["model.implementation=triton"])
    assert moe_config(cfg.model).implementation == "triton"


@pytest.mark.parametrize("text,overrides,key", [
    ("stepz: 3\n", [], "stepz"),                        # unknown key in a file
    ("", ["model.d_modle=3"], "d_modle"),               # unknown key on the command line
    ("steps: many\n", [], "steps"),                     # wrong type
    ("", ["optim.lr=fast"], "lr"),                      # wrong type on the command line
    ("steps: 3\nsteps: 4\n", [], "steps"),              # set twice in one file
    ("", ["steps=3", "steps=4"], "steps"),              # set twice on the command line
    ("", ["steps=0"], "steps"),                         # out of range
    ("", ["model.top_k=9"], "top_k"),                   # invalid model (top_k > E)
    ("", ["model.implementation=[trion]"], "implementation"),  # unknown backend
    ("", ["optim.lr=-0.05"], "optim.lr"),               # optimiser ranges
    ("", ["optim.lr=nan"], "optim.lr"),
    ("", ["optim.b1=1.5"], "optim.b1"),
    ("", ["optim.b2=-1"], "optim.b2"),
    ("", ["optim.clip_norm=0"], "optim.clip_norm"),
    ("", ["optim.weight_decay=-1"], "optim.weight_decay"),
    ("", ["optim.warmup_steps=-1"], "optim.warmup_steps"),
    ("", ["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    ("", ["data.max_bytes=-5"], r"^data\.max_bytes=-5 must be >= 1"),  # was text[:-5]
    ("", ["data.seed=-1"], r"^data\.seed=-1 must be an integer in \[0, 2\*\*63 - 1\]"),
    ("", ["seed=100000000000000000000"], r"^seed=100000000000000000000 must be"),
    # errors of the model's configs name the keys that set their fields
    ("", ["model.dtype=float64"], r"^model\.dtype='float64'.*64-bit"),
    ("", ["model.dtype=int8"], r"^model\.dtype='int8'.*floating"),
    ("", ["model.dtype=float16"], r"^model\.dtype=float16: AdamW.*use bfloat16"),
    ("", ["model=5"], r"^model=5: model is a section; set its keys"),  # a merge error
    ("data: 3\n", [], r"^data=3: data is a section"),
    ("- 1\n- 2\n", [], r"bad.yaml: a config is a mapping of keys"),
    ("", ["model.router=expert_choice", "model.normalize_weights=false"],
     r"^model\.router=expert_choice .*set parallel\.expert_parallel=false"),
    ("", ["parallel.exchange=foo"], r"^parallel\.exchange='foo'"),
    ("", ["model.num_kv_heads=3"], r"^model\.num_kv_heads=3 .*model\.num_heads=4"),
    ("", ["model.d_model=30"], r"^model\.d_model=30 .*model\.num_heads=4"),
])
def test_errors_name_the_key(tmp_path, text, overrides, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key):
        load_config(path, overrides)


def test_trained_model_follows_jax_matmul_precision():
    """Training runs at JAX's matmul precision (TF32 for float32 on a GPU unless set,
    as the MFU probe does), not at the full float32 that a loaded Mixtral keeps for
    Hugging Face parity: only routing and the K-way combine stay at HIGHEST."""
    cfg = load_config(next(p for p in CONFIGS if p.stem == "tiny"))
    assert cfg.model.dtype == "float32"
    graphdef, state = nnx.split(build_model(cfg, 64, mesh=None, plan=None))
    with jax.default_matmul_precision("tensorfloat32"):
        found = dot_precisions(lambda s, ids: nnx.merge(graphdef, s)(ids).logits, state,
                               jnp.zeros((2, 8), jnp.int32))
    assert {p.precision for p in found} == {("HIGH", "HIGH"), ("HIGHEST", "HIGHEST")}, found


def test_model_config_is_moe_config_for_the_moe_options():
    """One set of fields and defaults: every MoEConfig option that is a model key has
    MoEConfig's default, and a value set for each on the command line reaches the
    blocks' MoEConfig."""
    defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    model = ModelConfig()
    assert {"router_jitter", "shared_d_ff", "normalize_weights", "z_loss_coef"} <= set(MOE_KEYS)
    for key in MOE_KEYS:
        assert getattr(model, key) == defaults[key], key
    overrides = dict(activation="clamped_swiglu", router="sigmoid", normalize_weights=True,
                     num_groups=2, topk_groups=1, routed_scaling_factor=2.0,
                     bias_update_rate=0.01, capacity_factor=1.5, drop_policy="probability",
                     num_shared_experts=1, shared_d_ff=32, router_jitter=0.1,
                     lb_loss_coef=0.02, seq_aux_loss_coef=0.001, z_loss_coef=0.003,
                     implementation="reference", group_score="max", weight_norm_p=2.0,
                     router_bias=True, selection_bias=True, weight_side="input",
                     expert_bias=True, shared_expert_gate=True, swiglu_limit=5.0,
                     swiglu_alpha=1.5, loss_convention="megatron",
                     weight_norm_eps=1e-6)
    assert set(overrides) == set(MOE_KEYS)
    cfg = load_config(None, [f"model.{k}={v}" for k, v in overrides.items()])
    moe = moe_config(cfg.model, cfg.parallel)
    for key, value in overrides.items():
        assert getattr(moe, key) == value, key


@pytest.mark.parametrize("overrides,devices,match", [
    (["parallel.group_size=2"], 8, r"^no expert-parallel plan for model.num_experts=8 on 8 "
     r"devices with .*parallel.group_size=2 .*: group \[0, 1\] holds 4 experts"),
    (["parallel.devices=3"], 3, r"^no expert-parallel plan .* on 3 devices with "
     r"parallel.topology='uniform', parallel.expert_capacity=2"),
    (["parallel.exchange=hierarchical"], 8, r"^parallel.exchange='hierarchical' .* one node"),
])
def test_plan_errors_name_the_parallel_keys(overrides, devices, match):
    """Errors of the planner and the mesh arrive in the config's terms."""
    import jax

    from aristax.train.parallel_setup import plan_and_mesh

    cfg = load_config("experiments/configs/tiny.yaml", overrides)
    with pytest.raises(ValueError, match=match):
        plan_and_mesh(cfg, jax.devices()[:devices])


def test_expert_capacity_applies_to_a_topology_file(tmp_path):
    """parallel.expert_capacity replaces a topology file's experts per device as it
    does a preset's (a user trial found the file's kept: 2 groups instead of 1)."""
    from aristax.planner.topology import perlmutter
    from aristax.train.parallel_setup import make_topology

    path = tmp_path / "topology.json"
    perlmutter(2).save(path)
    preset = make_topology("perlmutter", 8, expert_capacity=1)
    from_file = make_topology(str(path), 8, expert_capacity=1)
    np.testing.assert_array_equal(from_file.expert_capacity, np.ones(8))
    assert from_file == preset
    assert make_topology(str(path), 8) == perlmutter(2)
