"""Hugging Face Mixtral checkpoints <-> ``aristax.models.Mixtral`` (no torch needed).

A checkpoint is a local directory with ``config.json`` and ``*.safetensors`` (one file,
or shards listed in ``model.safetensors.index.json``). Two expert layouts exist:

* per-expert (what transformers 4.x and 5.x ``save_pretrained`` write, and what the
  published Mixtral checkpoints hold)::

    model.layers.{i}.block_sparse_moe.gate.weight            [E, D]
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  [F, D]   gate
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  [F, D]   up
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  [D, F]   down

* fused (transformers 5.x in-memory layout, ``conversion_mapping.py``)::

    model.layers.{i}.mlp.gate.weight                [E, D]
    model.layers.{i}.mlp.experts.gate_up_proj       [E, 2F, D]  (gate rows, then up)
    model.layers.{i}.mlp.experts.down_proj          [E, D, F]

Both are read; the per-expert layout is written. aristax stacks experts along E:
gate_edf/up_edf [E, D, F] = w1/w3 transposed, down_efd [E, F, D] = w2 transposed.
"""

from __future__ import annotations

import contextlib
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

from aristax.models.mixtral_config import MixtralConfig

if TYPE_CHECKING:
    from aristax.models.mixtral import Mixtral

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


def _moe_prefix(reader: _Reader, i: int) -> str:
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
    if fused in reader:
        return f"model.layers.{i}.mlp"
    if f"model.layers.{i}.mlp.gate.weight" in reader:
        return f"model.layers.{i}.mlp"
    return f"model.layers.{i}.block_sparse_moe"


def _read_experts(reader: _Reader, prefix: str, cfg: MixtralConfig):
    """(gate_edf, up_edf, down_efd) from either expert layout."""
    E, D, F = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in reader:
        gate_up = reader.get(fused, (E, 2 * F, D))
        down = reader.get(f"{prefix}.experts.down_proj", (E, D, F))
        return (gate_up[:, :F].transpose(0, 2, 1), gate_up[:, F:].transpose(0, 2, 1),
                down.transpose(0, 2, 1))

    def stack(w: str, shape):
        return np.stack([reader.get(f"{prefix}.experts.{e}.{w}.weight", shape).T
                         for e in range(E)])

    return stack("w1", (F, D)), stack("w3", (F, D)), stack("w2", (D, F))


def _set(param: nnx.Variable, array: np.ndarray, dtype) -> None:
    param.set_value(jnp.asarray(np.ascontiguousarray(array), dtype))


def load_pretrained(model_class: type[Mixtral], directory: str | os.PathLike, *,
                    dtype: str | None = None,
                    matmul_precision: str | None = MixtralConfig.matmul_precision,
                    mesh=None, plan=None) -> Mixtral:
    """Read a Hugging Face Mixtral directory into a ``Mixtral`` (in eval mode).

    Args:
      model_class: ``Mixtral`` (``Mixtral.from_pretrained`` passes itself: the model
        imports this module, not the other way round).
      directory: holds config.json and the safetensors file(s).
      dtype: parameter dtype (default: ``MixtralConfig.dtype``, "float32").
      matmul_precision: ``MixtralConfig.matmul_precision`` (default "highest": float32
        products in full float32, as Hugging Face computes them).
      mesh, plan: as for ``Mixtral(...)``: expert parallelism over ``mesh``, the
        experts (logical in the checkpoint) stored in ``plan``'s physical order.
    Raises:
      CheckpointError: a tensor is missing or its shape differs; the message names
        the tensor, its expected and its found shape.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face checkpoint")
    overrides = {"matmul_precision": matmul_precision}
    if dtype is not None:
        overrides["dtype"] = dtype
    cfg = MixtralConfig.from_hf(_read_json(config_path), **overrides)
    reader = _Reader(directory)
    model = nnx.eval_shape(lambda: model_class(cfg, rngs=nnx.Rngs(0), mesh=mesh))
    V, D, dt = cfg.vocab_size, cfg.hidden_size, cfg.dtype
    H, G, Dh, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
        cfg.num_local_experts

    _set(model.embed_vd, reader.get("model.embed_tokens.weight", (V, D)), dt)
    _set(model.norm.weight_d, reader.get("model.norm.weight", (D,)), dt)
    if model.lm_head_dv is not None:
        _set(model.lm_head_dv, reader.get("lm_head.weight", (V, D)).T, dt)
    elif "lm_head.weight" in reader:
        reader.used.add("lm_head.weight")  # tied: the head is the embedding
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        _set(layer.input_norm.weight_d, reader.get(f"{p}.input_layernorm.weight", (D,)), dt)
        _set(layer.post_attention_norm.weight_d,
             reader.get(f"{p}.post_attention_layernorm.weight", (D,)), dt)
        attn = layer.attn
        _set(attn.q_dn, reader.get(f"{p}.self_attn.q_proj.weight", (H * Dh, D)).T, dt)
        _set(attn.k_dm, reader.get(f"{p}.self_attn.k_proj.weight", (G * Dh, D)).T, dt)
        _set(attn.v_dm, reader.get(f"{p}.self_attn.v_proj.weight", (G * Dh, D)).T, dt)
        _set(attn.o_nd, reader.get(f"{p}.self_attn.o_proj.weight", (D, H * Dh)).T, dt)
        moe_prefix = _moe_prefix(reader, i)
        _set(layer.moe.router.weight_de, reader.get(f"{moe_prefix}.gate.weight", (E, D)).T, dt)
        gate, up, down = _read_experts(reader, moe_prefix, cfg)
        _set(layer.moe.experts.gate_edf, gate, dt)
        _set(layer.moe.experts.up_edf, up, dt)
        _set(layer.moe.experts.down_efd, down, dt)
        layer.moe.expert_layout.set_value(jnp.arange(E, dtype=jnp.int32))  # logical order
    _check_all_set(model)
    if plan is not None:
        for layer in model.layers:
            layer.moe.apply_plan(plan)
    unused = reader.unused()
    if unused:
        warnings.warn(f"{len(unused)} tensors in {directory} were not used: {unused[:8]}",
                      stacklevel=2)
    model.eval()
    return model


def _check_all_set(model: Mixtral) -> None:
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


# The MoEConfig fields that change what a MoE block computes (not how or what it
# trains with): a checkpoint in Mixtral's layout holds only Mixtral's values of them.
_MOE_FIELDS_OF_A_CHECKPOINT = (
    "num_experts", "top_k", "d_model", "d_ff", "activation", "router", "normalize_weights",
    "num_groups", "topk_groups", "routed_scaling_factor", "bias_update_rate",
    "capacity_factor", "num_shared_experts")


def _check_mixtral_moe(model: Mixtral) -> None:
    """Raise unless every MoE block computes Mixtral's (``config.moe_config()``)."""
    mixtral = model.config.moe_config()
    for i, layer in enumerate(model.layers):
        differ = [f"{name}={getattr(layer.moe.config, name)!r} (Mixtral: "
                  f"{getattr(mixtral, name)!r})" for name in _MOE_FIELDS_OF_A_CHECKPOINT
                  if getattr(layer.moe.config, name) != getattr(mixtral, name)]
        if differ:
            raise ValueError(
                f"layer {i}'s MoE block is not Mixtral's: {', '.join(differ)}; a Hugging "
                "Face Mixtral checkpoint cannot hold it (it would load as another model). "
                "Save the parameters with orbax (nnx.state(model)) instead")


def hf_tensors(model: Mixtral) -> dict[str, np.ndarray]:
    """The model's weights as Hugging Face (per-expert layout) numpy tensors; raises for
    a model built with a ``moe_config`` other than Mixtral's."""
    _check_mixtral_moe(model)
    cfg = model.config
    arr: Callable = lambda p: np.asarray(p[...])  # noqa: E731
    out = {"model.embed_tokens.weight": arr(model.embed_vd),
           "model.norm.weight": arr(model.norm.weight_d)}
    if model.lm_head_dv is not None:
        out["lm_head.weight"] = arr(model.lm_head_dv).T
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = arr(layer.input_norm.weight_d)
        out[f"{p}.post_attention_layernorm.weight"] = arr(layer.post_attention_norm.weight_d)
        for name, param in (("q_proj", layer.attn.q_dn), ("k_proj", layer.attn.k_dm),
                            ("v_proj", layer.attn.v_dm), ("o_proj", layer.attn.o_nd)):
            out[f"{p}.self_attn.{name}.weight"] = arr(param).T
        m = f"{p}.block_sparse_moe"
        out[f"{m}.gate.weight"] = arr(layer.moe.router.weight_de).T
        ex = layer.moe.logical_params()  # a plan's physical slots back in expert order
        for w, param in (("w1", ex.gate_edf), ("w3", ex.up_edf), ("w2", ex.down_efd)):
            stacked = np.asarray(param)
            for e in range(cfg.num_local_experts):
                out[f"{m}.experts.{e}.{w}.weight"] = stacked[e].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_pretrained(
    model: Mixtral, directory: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Write config.json and safetensors in the layout transformers 5.x writes.

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
