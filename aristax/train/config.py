"""Experiment configs: typed dataclasses, YAML files that state only their differences,
and ``key=value`` overrides, merged and validated by OmegaConf structured configs.

    cfg = load_config("experiments/configs/tiny.yaml", ["steps=50", "optim.lr=1e-3"])

Errors name the key: an unknown key, a value of the wrong type, a key set twice (in
one YAML file, or twice on the command line) and values out of range all raise
``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aristax.config import MoEConfig
from aristax.models.mixtral import MixtralConfig


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


@dataclasses.dataclass
class LMConfig:
    """The language model around the MoE blocks, and the widths they share with it."""

    # None: the data's (256 for bytes, a tokenizer's, a token array's max id + 1); a
    # value must cover the data's ids (a larger one only widens the embedding)
    vocab_size: Optional[int] = None
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 128
    rope_theta: float = 10000.0
    num_experts: int = 8
    top_k: int = 2
    d_ff: int = 128
    dtype: str = "float32"  # the parameters' dtype (MoEConfig.param_dtype)


# MoEConfig fields that are not model.X keys: the widths above, the dtypes (model.dtype
# is the parameters'), and what the trainer or parallel.X sets.
_NOT_MOE_KEYS = ("num_experts", "top_k", "d_model", "d_ff", "dtype", "param_dtype",
                 "debug_checks", "num_chunks", "exchange")
# A type OmegaConf can check where MoEConfig's cannot be (a name or a list of names).
_KEY_TYPES = {"implementation": Optional[Any]}
MOE_KEYS = tuple(f.name for f in dataclasses.fields(MoEConfig) if f.name not in _NOT_MOE_KEYS)
_MOE_TYPES = typing.get_type_hints(MoEConfig)

ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [(f.name, _KEY_TYPES.get(f.name, _MOE_TYPES[f.name]), dataclasses.field(default=f.default))
     for f in dataclasses.fields(MoEConfig) if f.name in MOE_KEYS],
    bases=(LMConfig,),
    namespace={"__doc__": "A decoder LM whose FFN blocks are ``aristax.MoE`` (attention "
               "as Mixtral's): ``LMConfig``'s keys, and every ``MoEConfig`` option of "
               "the blocks (``MOE_KEYS``) with MoEConfig's own defaults."})
ModelConfig.__module__ = __name__


@dataclasses.dataclass
class DataConfig:
    """``source``: "stdlib" (the Python standard library's .py files: on every
    machine), a directory of text files, or a ``.npy`` file of token ids."""

    source: str = "stdlib"
    tokenizer: Optional[str] = None  # a Hugging Face tokenizer.json (needs `tokenizers`)
    max_bytes: int = 4_000_000
    held_out_fraction: float = 0.05
    batch_size: int = 16  # global, over every process
    seed: int = 0


@dataclasses.dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0


@dataclasses.dataclass
class ParallelConfig:
    """Devices, topology and the expert-parallel plan.

    ``devices``: simulated CPU devices per run when JAX runs on the CPU, in place of
    a device count in XLA_FLAGS (0: leave as found). ``topology``: a preset of ``aristax.planner.topology.preset`` or a
    JSON file; ``group_size``: expert-parallel group size (0: the planner decides);
    ``expert_capacity``: experts one device can hold (0: the topology's), the memory
    limit that makes LysiGroup form groups.
    """

    devices: int = 8
    topology: str = "uniform"
    expert_capacity: int = 0
    expert_parallel: bool = True
    group_size: int = 0
    exchange: Optional[str] = None  # the all-to-all strategy (MoEConfig.exchange)
    num_chunks: int = 0  # 0: the plan's Lancet partition count


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 100
    keep: int = 2
    resume: bool = False
    # with resume: the step to resume from (None: the latest); later checkpoints are
    # deleted, as the run writes them anew (after a corrupt latest checkpoint)
    step: Optional[int] = None
    # with resume: accept training data whose contents differ from the checkpointed run's
    accept_changed_data: bool = False


@dataclasses.dataclass
class TrainConfig:
    name: str = "tiny"
    out_dir: str = "runs/${name}"
    steps: int = 300
    log_every: int = 25
    eval_every: int = 100
    eval_batches: int = 4
    seed: int = 0
    progress: bool = True
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)


def _check_sections(layers, path) -> None:
    """ConfigError unless each layer (the file, the overrides) is a mapping whose
    sections (model, data, ...) are mappings too (OmegaConf's merge error names
    neither)."""
    sections = [f.name for f in dataclasses.fields(TrainConfig)
                if f.default_factory is not dataclasses.MISSING]  # model, data, ...
    for layer in layers:
        if not isinstance(layer, DictConfig):
            raise ConfigError(f"{path}: a config is a mapping of keys (e.g. 'steps: 100'), "
                              f"not a {type(layer).__name__}")
        for name in sections:
            if name in layer and not isinstance(layer[name], DictConfig):
                raise ConfigError(f"{name}={layer[name]!r}: {name} is a section; set its "
                                  f"keys, e.g. {name}.<key>=value")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The base ``TrainConfig``, then the YAML file, then ``key=value`` overrides.

    Raises:
      ConfigError: naming the key that is unknown, mistyped, set twice or invalid.
    """
    base = OmegaConf.structured(TrainConfig)
    layers = []
    try:
        if path is not None:
            layers.append(OmegaConf.load(path))
        keys = [o.split("=", 1)[0].strip() for o in overrides]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ConfigError(f"override key {twice[0]!r} is set twice on the command line")
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. optim.lr=1e-3)")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        _check_sections(layers, path)
        merged = OmegaConf.merge(base, *layers)
        cfg: TrainConfig = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OSError as err:  # the file: "PATH: reason", without the errno
        raise ConfigError(f"{path}: {err.strerror or err}") from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigError(f"config key {key!r}: {err}".split("\n")[0] if key else str(err)) from None
    except Exception as err:  # YAML syntax, duplicate keys in a file
        if "duplicate key" in str(err):
            raise ConfigError(f"{path}: {str(err).splitlines()[-2].strip()} is set twice "
                              f"({' '.join(str(err).split())})") from None
        raise ConfigError(f"{path}: {err}") from None
    validate(cfg)
    return cfg


MAX_SEED = 2**63 - 1  # the largest seed JAX's keys (int64) and grain's shuffle both take


def validate(cfg: TrainConfig) -> None:
    """Range checks (types are checked by OmegaConf); the model config validates itself."""
    positive = {"steps": cfg.steps, "log_every": cfg.log_every, "eval_every": cfg.eval_every,
                "eval_batches": cfg.eval_batches, "data.batch_size": cfg.data.batch_size,
                "checkpoint.every": cfg.checkpoint.every, "checkpoint.keep": cfg.checkpoint.keep,
                "model.seq_len": cfg.model.seq_len, "data.max_bytes": cfg.data.max_bytes}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    for key, value in {"seed": cfg.seed, "data.seed": cfg.data.seed}.items():
        if not 0 <= value <= MAX_SEED:
            raise ConfigError(f"{key}={value} must be an integer in [0, 2**63 - 1]")
    o = cfg.optim
    optim_ranges = {"lr": (o.lr, 0 < o.lr, "> 0"),
                    "b1": (o.b1, 0 <= o.b1 < 1, "in [0, 1)"),
                    "b2": (o.b2, 0 <= o.b2 < 1, "in [0, 1)"),
                    "clip_norm": (o.clip_norm, 0 < o.clip_norm, "> 0"),
                    "weight_decay": (o.weight_decay, 0 <= o.weight_decay, ">= 0"),
                    "warmup_steps": (o.warmup_steps, 0 <= o.warmup_steps, ">= 0"),
                    "min_lr_ratio": (o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "in [0, 1]")}
    for key, (value, ok, want) in optim_ranges.items():
        if not (ok and math.isfinite(value)):
            raise ConfigError(f"optim.{key}={value} must be finite and {want}")
    if cfg.checkpoint.step is not None and (cfg.checkpoint.step < 1 or not cfg.checkpoint.resume):
        raise ConfigError(f"checkpoint.step={cfg.checkpoint.step} picks the step to resume from: "
                          "give a saved step >= 1 together with checkpoint.resume=true")
    if not 0 < cfg.data.held_out_fraction < 1:
        raise ConfigError(f"data.held_out_fraction={cfg.data.held_out_fraction} must be in (0, 1)")
    if min(cfg.parallel.devices, cfg.parallel.group_size, cfg.parallel.num_chunks,
           cfg.parallel.expert_capacity) < 0:
        raise ConfigError("parallel.devices, group_size, num_chunks and expert_capacity must "
                          "be >= 0 (0: decide automatically)")
    m = cfg.model
    if m.router == "expert_choice" and cfg.parallel.expert_parallel:
        raise ConfigError("model.router=expert_choice picks tokens over the whole batch, which "
                          "expert parallelism splits: set parallel.expert_parallel=false")
    if m.dtype == "float16":
        raise ConfigError("model.dtype=float16: AdamW keeps its moments in the parameters' "
                          "dtype, where its eps (1e-8) is 0, so an update of a zero gradient "
                          "is 0/0 = NaN; use bfloat16 (16 bits with float32's range) or "
                          "float32")
    if m.num_heads >= 1 and m.d_model % m.num_heads:
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.num_heads="
                          f"{m.num_heads} (each head gets d_model / num_heads dims)")
    try:
        moe_config(m, cfg.parallel)
        mixtral_config(m)
    except ValueError as err:
        raise ConfigError(_with_config_keys(str(err))) from None


# The MixtralConfig / MoEConfig fields that keys of another name set; every other field
# X of theirs is set by model.X.
_KEY_OF_FIELD = {
    "hidden_size": "model.d_model", "intermediate_size": "model.d_ff",
    "num_hidden_layers": "model.num_layers", "num_attention_heads": "model.num_heads",
    "num_key_value_heads": "model.num_kv_heads", "num_local_experts": "model.num_experts",
    "num_experts_per_tok": "model.top_k", "max_position_embeddings": "model.seq_len",
    "router_aux_loss_coef": "model.lb_loss_coef", "param_dtype": "model.dtype",
    "exchange": "parallel.exchange", "num_chunks": "parallel.num_chunks"}


def _with_config_keys(message: str) -> str:
    """A MoEConfig/MixtralConfig error with the fields it names written as the config
    keys that set them ("MixtralConfig.num_attention_heads=3" -> "model.num_heads=3")."""
    def key(field: re.Match) -> str:
        owner, name = field[1], field[2]
        return _KEY_OF_FIELD.get(name, f"model.{name}" if owner else name)

    return re.sub(r"(?<![\w.])(MoEConfig\.|MixtralConfig\.)?(\w+)(?==)", key, message)


def mixtral_config(m: ModelConfig, vocab_size: int | None = None) -> MixtralConfig:
    """The attention/embedding part of the model as a ``MixtralConfig``. Its products
    run at JAX's matmul precision (``matmul_precision=None``): training follows
    ``jax_default_matmul_precision`` (TF32 for float32 on a GPU unless set), as the MFU
    probe does; the model's own default, full float32, is for Hugging Face parity."""
    return MixtralConfig(
        vocab_size=vocab_size or m.vocab_size or 256, hidden_size=m.d_model,
        intermediate_size=m.d_ff,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, num_local_experts=m.num_experts,
        num_experts_per_tok=m.top_k, rope_theta=m.rope_theta,
        max_position_embeddings=m.seq_len, router_aux_loss_coef=m.lb_loss_coef,
        bos_token_id=None, eos_token_id=None, dtype=m.dtype, matmul_precision=None)


def moe_config(m: ModelConfig, p: ParallelConfig | None = None) -> MoEConfig:
    """The ``aristax.MoEConfig`` of every MoE block."""
    fields: dict[str, Any] = {name: getattr(m, name) for name in MOE_KEYS} | dict(
        num_experts=m.num_experts, top_k=m.top_k, d_model=m.d_model, d_ff=m.d_ff,
        param_dtype=m.dtype)
    if p is not None:
        fields["exchange"] = p.exchange
        if p.num_chunks:
            fields["num_chunks"] = p.num_chunks
    return MoEConfig(**fields)
