"""Hugging Face checkpoints <-> the models of ``aristax.models`` (Mixtral, Qwen3-MoE;
no torch needed).

A checkpoint is a local directory with ``config.json`` and ``*.safetensors`` (one file,
or shards listed in ``model.safetensors.index.json``). Every family shares the
embedding, norms, attention (Qwen3-MoE adds ``self_attn.q_norm/k_norm.weight`` [Dh]
and, with ``attention_bias``, ``self_attn.{q,k,v,o}_proj.bias``) and head tensors.
MoE blocks come in two expert layouts:

* per-expert (what transformers 4.x and 5.x ``save_pretrained`` write, and what the
  published checkpoints hold); Mixtral::

    model.layers.{i}.block_sparse_moe.gate.weight            [E, D]
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  [F, D]   gate
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  [F, D]   up
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  [D, F]   down

  Qwen3-MoE: ``model.layers.{i}.mlp.gate.weight`` and
  ``mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight``;

* fused (transformers 5.x in-memory layout, ``conversion_mapping.py``), both::

    model.layers.{i}.mlp.gate.weight                [E, D]
    model.layers.{i}.mlp.experts.gate_up_proj       [E, 2F, D]  (gate rows, then up)
    model.layers.{i}.mlp.experts.down_proj          [E, D, F]

Both are read; the per-expert layout is written. aristax stacks experts along E:
gate_edf/up_edf [E, D, F] = w1/w3 transposed, down_efd [E, F, D] = w2 transposed.
A Qwen3-MoE dense layer holds ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from aristax.models import generation_config
from aristax.models.decoder_config import DecoderConfig
from aristax.sharding import DecoderAxes

if TYPE_CHECKING:
    from aristax.models.decoder import DecoderLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_GLOB = "model-*-of-*.safetensors"
# Buffers some old checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or not what it should be, or a tensor is
    missing from it or has the wrong shape; the message names the file or tensor."""


_REDO = "download or save the checkpoint again"


@contextlib.contextmanager
def _open(path: Path) -> Iterator:
    """``safe_open(path)``; a CheckpointError naming the file where it is missing,
    truncated or not a safetensors file."""
    if not path.is_file():
        state = "is not a file" if path.exists() else "is missing"
        raise CheckpointError(f"weight file {path} {state}: {_REDO}")
    try:
        handle = safe_open(path, framework="np")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"weight file {path} is not a readable .safetensors file "
                              f"({err}); it may be truncated: {_REDO}") from None
    with handle as f:
        yield f


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``; a CheckpointError naming the file where it is not
    valid JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): {_REDO}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object: {_REDO}")
    return data


class _Reader:
    """Lazy access to the tensors of a checkpoint directory, by name: ``model.safetensors``
    when present (as transformers prefers it), else the shards of the index, else every
    ``*.safetensors`` file."""

    def __init__(self, directory: Path):
        index = directory / INDEX_FILE
        single = directory / SINGLE_FILE
        if single.exists():
            with _open(single) as f:
                files = {name: single for name in f.keys()}
        elif index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no \"weight_map\" object (tensor name -> "
                                      f"file): {_REDO}")
            files = {name: directory / f for name, f in weight_map.items()}
        else:
            files = {}
            shards = sorted(directory.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"no *.safetensors files in {directory}: put the "
                                        "checkpoint's weight files there")
            for shard in shards:
                with _open(shard) as f:
                    files.update({name: shard for name in f.keys()})
        self.directory = directory
        self.files = files
        self.used: set[str] = set()
        self._shapes: dict[str, tuple[int, ...]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            with _open(self.files[name]) as f:
                self._shapes[name] = tuple(f.get_slice(name).get_shape())
        return self._shapes[name]

    def get(self, name: str, expected: tuple[int, ...]) -> np.ndarray:
        """The tensor ``name``, checked against its expected shape."""
        if name not in self.files:
            held = sorted({p.name for p in self.files.values()})
            raise CheckpointError(
                f"checkpoint {self.directory} is missing tensor {name!r} "
                f"(expected shape {expected}); its weight files ({', '.join(held[:3]) or 'none'}"
                f"{', ...' if len(held) > 3 else ''}) do not hold it: {_REDO}"
            )
        found = self.shape(name)
        if found != tuple(expected):
            raise CheckpointError(
                f"tensor {name!r} in {self.directory} has shape {found}, expected {expected}"
            )
        with _open(self.files[name]) as f:
            array = f.get_tensor(name)
        self.used.add(name)
        return array

    def unused(self) -> list[str]:
        return sorted(n for n in self.files
                      if n not in self.used and not n.endswith(_IGNORED_SUFFIXES))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a family's per-expert checkpoint puts its MoE blocks: the prefix under
    ``model.layers.{i}`` it writes and the names of each expert's gate, up and down
    projections."""

    moe_prefix: str
    expert_names: tuple[str, str, str]


_LAYOUTS = {
    "mixtral": _Layout("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": _Layout("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _layout(cfg: DecoderConfig) -> _Layout:
    if cfg.model_type not in _LAYOUTS:
        raise ValueError(f"no Hugging Face checkpoint layout for model_type="
                         f"{cfg.model_type!r}; known: {', '.join(sorted(_LAYOUTS))}")
    return _LAYOUTS[cfg.model_type]


def _moe_prefix(reader: _Reader, i: int, layout: _Layout) -> str:
    """The fused layout's (transformers 5 in memory) ``mlp`` where the checkpoint holds
    it, else the family's own prefix."""
    if (f"model.layers.{i}.mlp.experts.gate_up_proj" in reader
            or f"model.layers.{i}.mlp.gate.weight" in reader):
        return f"model.layers.{i}.mlp"
    return f"model.layers.{i}.{layout.moe_prefix}"


def _read_experts(reader: _Reader, prefix: str, cfg: DecoderConfig, layout: _Layout):
    """(gate_edf, up_edf, down_efd) from either expert layout."""
    E, D, F = cfg.num_routed_experts, cfg.hidden_size, cfg.expert_intermediate_size
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in reader:
        gate_up = reader.get(fused, (E, 2 * F, D))
        down = reader.get(f"{prefix}.experts.down_proj", (E, D, F))
        return (gate_up[:, :F].transpose(0, 2, 1), gate_up[:, F:].transpose(0, 2, 1),
                down.transpose(0, 2, 1))

    def stack(w: str, shape):
        return np.stack([reader.get(f"{prefix}.experts.{e}.{w}.weight", shape).T
                         for e in range(E)])

    gate, up, down = layout.expert_names
    return stack(gate, (F, D)), stack(up, (F, D)), stack(down, (D, F))


def _set(param: nnx.Variable, array: np.ndarray, dtype) -> None:
    param.set_value(jnp.asarray(np.ascontiguousarray(array), dtype))


def read_config_json(directory: str | os.PathLike) -> dict:
    """The config.json object of a checkpoint directory; FileNotFoundError where there
    is none, CheckpointError where it is not a JSON object."""
    config_path = Path(directory) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face checkpoint")
    return _read_json(config_path)


def read_generation_config(directory: str | os.PathLike, config: DecoderConfig
                           ) -> generation_config.GenerationConfig:
    """The directory's generation_config.json, else one made from ``config`` (as HF's
    ``from_pretrained``); a CheckpointError where the file is not a JSON object."""
    path = Path(directory) / generation_config.FILE
    if not path.exists():
        return generation_config.GenerationConfig.from_model_config(config)
    return generation_config.GenerationConfig.from_hf(_read_json(path), source=str(path))


def load_pretrained(model_class: type[DecoderLM], directory: str | os.PathLike, *,
                    dtype: str | None = None,
                    matmul_precision: str | None = DecoderConfig.matmul_precision,
                    mesh=None, plan=None, axes: DecoderAxes = DecoderAxes()) -> DecoderLM:
    """Read a Hugging Face directory into a ``model_class`` (in eval mode).

    Args:
      model_class: ``Mixtral`` or ``Qwen3Moe`` (``from_pretrained`` passes its class:
        the models import this module, not the other way round); its
        ``config_class.from_hf`` reads config.json and refuses another model_type.
      directory: holds config.json and the safetensors file(s).
      dtype: parameter dtype (default: the config's, "float32").
      matmul_precision: ``DecoderConfig.matmul_precision`` (default "highest": float32
        products in full float32, as Hugging Face computes them).
      mesh, plan: as for ``Mixtral(...)``: expert parallelism over ``mesh``, the
        experts (logical in the checkpoint) stored in ``plan``'s physical order.
      axes: the parameters' sharding metadata (``aristax.sharding.DecoderAxes``).
    Raises:
      CheckpointError: a tensor is missing or its shape differs; the message names
        the tensor, its expected and its found shape.
    """
    directory = Path(directory)
    overrides = {"matmul_precision": matmul_precision}
    if dtype is not None:
        overrides["dtype"] = dtype
    cfg = model_class.config_class.from_hf(read_config_json(directory), **overrides)
    layout = _layout(cfg)
    reader = _Reader(directory)
    model = nnx.eval_shape(lambda: model_class(cfg, rngs=nnx.Rngs(0), mesh=mesh, axes=axes))
    V, D, dt = cfg.vocab_size, cfg.hidden_size, cfg.dtype
    E = cfg.num_routed_experts

    _set(model.embed_vd, reader.get("model.embed_tokens.weight", (V, D)), dt)
    _set(model.norm.weight_d, reader.get("model.norm.weight", (D,)), dt)
    if model.lm_head_dv is not None:
        _set(model.lm_head_dv, reader.get("lm_head.weight", (V, D)).T, dt)
    elif "lm_head.weight" in reader:
        reader.used.add("lm_head.weight")  # tied: the head is the embedding
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for name, (param, transpose) in _layer_params(layer, p).items():
            shape = tuple(param.get_value().shape)  # abstract here: shape only
            array = reader.get(name, shape[::-1] if transpose else shape)
            _set(param, array.T if transpose else array, dt)
        if layer.moe is None:
            continue
        moe_prefix = _moe_prefix(reader, i, layout)
        _set(layer.moe.router.weight_de, reader.get(f"{moe_prefix}.gate.weight", (E, D)).T, dt)
        gate, up, down = _read_experts(reader, moe_prefix, cfg, layout)
        _set(layer.moe.experts.gate_edf, gate, dt)
        _set(layer.moe.experts.up_edf, up, dt)
        _set(layer.moe.experts.down_efd, down, dt)
        layer.moe.expert_layout.set_value(jnp.arange(E, dtype=jnp.int32))  # logical order
    _check_all_set(model)
    if plan is not None:
        for layer in model.layers:
            if layer.moe is not None:
                layer.moe.apply_plan(plan)
    unused = reader.unused()
    if unused:
        warnings.warn(f"{len(unused)} tensors in {directory} were not used: {unused[:8]}",
                      stacklevel=2)
    model.generation_config = read_generation_config(directory, cfg)
    model.eval()
    return model


def _layer_params(layer, p: str) -> dict[str, tuple[nnx.Variable, bool]]:
    """HF name -> (parameter, whether HF holds it transposed) of one decoder layer's
    tensors outside its MoE block: norms, attention (q/k norms and biases where the
    layer has them) and a dense MLP."""
    attn = layer.attn
    out = {f"{p}.input_layernorm.weight": (layer.input_norm.weight_d, False),
           f"{p}.post_attention_layernorm.weight": (layer.post_attention_norm.weight_d, False)}
    for name, weight, bias in (("q_proj", attn.q_dn, attn.q_bias_n),
                               ("k_proj", attn.k_dm, attn.k_bias_m),
                               ("v_proj", attn.v_dm, attn.v_bias_m),
                               ("o_proj", attn.o_nd, attn.o_bias_d)):
        out[f"{p}.self_attn.{name}.weight"] = (weight, True)
        if bias is not None:
            out[f"{p}.self_attn.{name}.bias"] = (bias, False)
    if attn.q_norm is not None:
        out[f"{p}.self_attn.q_norm.weight"] = (attn.q_norm.weight_d, False)
        out[f"{p}.self_attn.k_norm.weight"] = (attn.k_norm.weight_d, False)
    if layer.mlp is not None:
        for name, param in (("gate_proj", layer.mlp.gate_df), ("up_proj", layer.mlp.up_df),
                            ("down_proj", layer.mlp.down_fd)):
            out[f"{p}.mlp.{name}.weight"] = (param, True)
    return out


def _layer_tensors(layer, p: str):
    """(HF name, numpy tensor in HF's layout) of one decoder layer outside its MoE
    block."""
    for name, (param, transpose) in _layer_params(layer, p).items():
        array = np.asarray(param[...])
        yield name, array.T if transpose else array


def _check_all_set(model: DecoderLM) -> None:
    """Every parameter was loaded; abstract RNG state (router jitter) gets key(0)."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        if not isinstance(value, jax.ShapeDtypeStruct):
            continue
        name = ".".join(map(str, path))
        if isinstance(var, nnx.Param):
            raise CheckpointError(f"parameter {name} was not loaded")
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            var.set_value(jax.random.split(jax.random.key(0), value.shape or None)
                          if value.shape else jax.random.key(0))
        else:
            var.set_value(jnp.zeros(value.shape, value.dtype))


# The MoEConfig fields that say how a MoE block computes or what it trains with, not
# what it computes; every other field (what it computes: E, K, widths, activation,
# routing, capacity, shared experts, biases, ... and any field added later) must hold
# the family's value, the only one a checkpoint in the family's layout can hold.
_MOE_FIELDS_NOT_IN_A_CHECKPOINT = frozenset((
    "implementation", "num_chunks", "exchange", "debug_checks", "dtype", "param_dtype",
    "lb_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "router_jitter", "drop_policy",
    "loss_convention"))


def _check_family_moe(model: DecoderLM) -> None:
    """Raise unless every MoE block computes the family's (``config.moe_config()``)."""
    own, name = model.config.moe_config(), model.config.display_name
    fields = [f.name for f in dataclasses.fields(own)
              if f.name not in _MOE_FIELDS_NOT_IN_A_CHECKPOINT]
    for i, layer in enumerate(model.layers):
        if layer.moe is None:
            continue
        differ = [f"{field}={getattr(layer.moe.config, field)!r} ({name}: "
                  f"{getattr(own, field)!r})" for field in fields
                  if getattr(layer.moe.config, field) != getattr(own, field)]
        if differ:
            raise ValueError(
                f"layer {i}'s MoE block is not {name}'s: {', '.join(differ)}; a Hugging "
                f"Face {name} checkpoint cannot hold it (it would load as another model). "
                "Save the parameters with orbax (nnx.state(model)) instead")


def hf_tensors(model: DecoderLM) -> dict[str, np.ndarray]:
    """The model's weights as Hugging Face (per-expert layout) numpy tensors; raises for
    a model built with a ``moe_config`` other than its family's."""
    _check_family_moe(model)
    cfg = model.config
    layout = _layout(cfg)
    gate_name, up_name, down_name = layout.expert_names
    arr: Callable = lambda p: np.asarray(p[...])  # noqa: E731
    out = {"model.embed_tokens.weight": arr(model.embed_vd),
           "model.norm.weight": arr(model.norm.weight_d)}
    if model.lm_head_dv is not None:
        out["lm_head.weight"] = arr(model.lm_head_dv).T
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        out.update(_layer_tensors(layer, p))
        if layer.moe is None:
            continue
        m = f"{p}.{layout.moe_prefix}"
        out[f"{m}.gate.weight"] = arr(layer.moe.router.weight_de).T
        ex = layer.moe.logical_params()  # a plan's physical slots back in expert order
        for w, param in ((gate_name, ex.gate_edf), (up_name, ex.up_edf),
                         (down_name, ex.down_efd)):
            stacked = np.asarray(param)
            for e in range(cfg.num_routed_experts):
                out[f"{m}.experts.{e}.{w}.weight"] = stacked[e].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_pretrained(
    model: DecoderLM, directory: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Write config.json, generation_config.json and safetensors in the layout
    transformers 5.x writes.

    With ``max_shard_bytes`` the tensors are split into ``model-0000i-of-0000n``
    shards plus ``model.safetensors.index.json`` (as ``save_pretrained`` shards).
    """
    tensors = hf_tensors(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # a previous save's weights would shadow these (a loader takes model.safetensors
    # before an index, so a sharded save over a single file would not be read)
    for stale in [directory / SINGLE_FILE, directory / INDEX_FILE,
                  *directory.glob(SHARD_GLOB)]:
        stale.unlink(missing_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    (directory / generation_config.FILE).write_text(
        json.dumps(model.generation_config.to_hf(), indent=2))
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(directory / SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map = {}
    n = len(shards)
    for j, shard in enumerate(shards, start=1):
        fname = f"model-{j:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(directory / fname), metadata=metadata)
        weight_map.update({name: fname for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    (directory / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
