"""One MoE layer's forward + backward: aristax.MoE against the dense ceiling, GShard and HF.

For each shape (T tokens, D model dim, F expert hidden dim, E experts, K per token)
and routing load, float32, in one run, interleaved rounds (each contender once per
round, timed on its second of two back-to-back calls; medians of its times and of
its per-round ratios):

* ``aristax.MoE`` (the nnx layer, Mixtral routing: softmax top-K renormalised),
  forward + backward under ``nnx.jit`` (the loss: sum of y plus the aux loss), as a
  user gets it (on the CPU: the fused "xla" moe_mlp loop);
* ``aristax.MoE unfused``: the same layer with the fused default off (permute, three
  "xla" grouped GEMMs, combine: the layer before the fused loop), for the before/after;
* the ceiling: a dense SwiGLU MLP of hidden K*F on all T tokens (the same FLOPs), JAX;
* the same at the experts' GEMM shapes: hidden F on T*K rows (each token K times), no
  routing (what the grouped GEMMs' narrower products cost on their own);
* the GShard one-hot einsum layer (capacity factor 1.0: dispatch and combine tensors
  [T, E, C], C = T*K/E; the overflow is dropped), JAX, the same weights;
* Hugging Face ``MixtralSparseMoeBlock`` with experts implementation "eager" (a loop
  over experts) and "grouped_mm" (``torch._grouped_mm``), torch using as many
  threads as JAX (the machine's cores), the same weights and routing.

With ``--block gpt_oss`` (``GptOssMLP``: clamped SwiGLU, expert biases, top-K softmax
with a router bias) or ``--block llama4_text`` (``Llama4TextMoe``: routing weights on
the experts' input, a shared expert; HF runs every expert on every token), the layer
is ``MoE.from_hf`` of that block with random weights, HF's contenders are that block
(Llama 4's experts have no "grouped_mm"), and there is no GShard row; results go to
``results/moe_layer_<block>_<platform>.json``.

Loads: "uniform" (a random router), "zipf" (a constant input feature whose router
weights are log Zipf(1.2) shares in random order, so a few experts take most tokens).
Default shapes are the issue's: (4096, 512, 1024, 8, 2), (4096, 512, 256, 32, 4),
(4096, 512, 128, 64, 8). Results: ``results/moe_layer_<platform>.json`` beside this
script, with the machine.

Usage: python experiments/benchmarks/moe_layer.py [--shapes T,D,F,E,K;...]
       [--loads uniform,zipf] [--rounds 5] [--no-hf] [--block mixtral] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aristax import MoE, MoEConfig
from aristax.argtypes import positive_int
from aristax.pallas_kernels.moe_mlp import api as moe_mlp_api

SHAPES = "4096,512,1024,8,2;4096,512,256,32,4;4096,512,128,64,8"
BLOCKS = ("mixtral", "gpt_oss", "llama4_text")


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(getattr(d, "device_kind", d)) for d in jax.devices()],
            # malloc settings change every contender's time (README, "What works today")
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}


def weights(T, D, F, E, load: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Router [D, E], gate/up [E, D, F], down [E, F, D] and x [T, D] (float32). With
    load "zipf", x[:, 0] = 1 and router row 0 holds log Zipf shares, skewing routing."""
    rng = np.random.default_rng(seed)
    w = {"router": rng.standard_normal((D, E)) * D ** -0.5,
         "gate": rng.standard_normal((E, D, F)) * D ** -0.5,
         "up": rng.standard_normal((E, D, F)) * D ** -0.5,
         "down": rng.standard_normal((E, F, D)) * F ** -0.5,
         "x": rng.standard_normal((T, D))}
    if load == "zipf":
        w["x"][:, 0] = 1.0
        w["router"][0] = np.log(rng.permutation(1.0 / np.arange(1, E + 1) ** 1.2))
    return {k: v.astype(np.float32) for k, v in w.items()}


@contextlib.contextmanager
def unfused_default():
    """The layer's fused default off (``moe_mlp.api.LAYER_DEFAULT`` emptied) inside."""
    default = dict(moe_mlp_api.LAYER_DEFAULT)
    moe_mlp_api.LAYER_DEFAULT.clear()
    try:
        yield
    finally:
        moe_mlp_api.LAYER_DEFAULT.update(default)


def aristax_step(w, K, layer: MoE | None = None, traced_in=None):
    """nnx.jit(value_and_grad) of the aristax.MoE layer holding ``w`` (or of ``layer``,
    e.g. ``MoE.from_hf`` of a block, on x = w["x"]); with ``traced_in`` (a context
    manager, e.g. ``unfused_default``) compiled here, inside it."""
    if layer is None:
        (D, E), F = w["router"].shape, w["gate"].shape[2]
        layer = MoE(MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F,
                              normalize_weights=True), rngs=nnx.Rngs(0))
        layer.router.weight_de.set_value(jnp.asarray(w["router"]))
        for name, key in (("gate_edf", "gate"), ("up_edf", "up"), ("down_efd", "down")):
            getattr(layer.experts, name).set_value(jnp.asarray(w[key]))

    def step(layer, x):
        def loss(layer, x):
            y, aux = layer(x)
            return jnp.sum(y) + aux["loss"]
        return nnx.value_and_grad(loss, argnums=(0, 1))(layer, x)
    x = jnp.asarray(w["x"])
    if traced_in is None:
        jitted = nnx.jit(step)
        return lambda: jitted(layer, x)
    # Compiled ahead of time inside the context, every trace cache cleared before and
    # after: the layer's inner jit would otherwise reuse another step's trace.
    graphdef, state = nnx.split(layer)
    jax.clear_caches()
    try:
        with traced_in():
            compiled = jax.jit(lambda state, x: step(nnx.merge(graphdef, state), x)).lower(
                state, x).compile()
    finally:
        jax.clear_caches()
    return lambda: compiled(state, x)


def dense_step(w, K, expert_shape: bool = False):
    """The ceiling: SwiGLU MLP of hidden K*F on all T tokens, forward + backward. With
    ``expert_shape``: hidden F on the T*K rows (each token K times), the experts' GEMM
    shapes without routing or grouping (the same FLOPs)."""
    rng = np.random.default_rng(1)
    (D, _), F = w["router"].shape, w["gate"].shape[2]
    H = F if expert_shape else K * F
    mats = [jnp.asarray(rng.standard_normal(s) * s[0] ** -0.5, jnp.float32)
            for s in ((D, H), (D, H), (H, D))]

    @jax.jit
    def step(mats, x):
        def loss(mats, x):
            h = jax.nn.silu(x @ mats[0]) * (x @ mats[1])
            return jnp.sum(h @ mats[2])
        return jax.value_and_grad(loss, argnums=(0, 1))(mats, x)
    x = jnp.asarray(np.repeat(w["x"], K, axis=0) if expert_shape else w["x"])
    return lambda: step(mats, x)


def gshard_layer(params, x, K: int, capacity: int):
    """GShard's dense dispatch: Mixtral routing, then each slot's place in its expert
    (top-1 choices of all tokens first), kept under ``capacity``; one-hot dispatch and
    combine tensors [T, E, C] and einsums."""
    E = params["router"].shape[1]
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    top, ids = jax.lax.top_k(probs, K)
    top = top / jnp.sum(top, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(ids, E)                          # [T, K, E]
    by_round = jnp.swapaxes(onehot, 0, 1).reshape(-1, E)     # [K*T, E], top-1 first
    place = (jnp.cumsum(by_round, axis=0) - by_round).reshape(K, -1, E).swapaxes(0, 1)
    place = jnp.sum(place * onehot, axis=-1).astype(jnp.int32)       # [T, K]
    kept = (place < capacity)[..., None, None]
    slot = jax.nn.one_hot(place, capacity)                   # [T, K, C]
    dispatch = jnp.sum(jnp.where(kept, onehot[..., None] * slot[:, :, None], 0), axis=1)
    combine = jnp.sum(jnp.where(kept, (top[..., None] * onehot)[..., None]
                                * slot[:, :, None], 0), axis=1)  # [T, E, C]
    xe = jnp.einsum("tec,td->ecd", dispatch, x)
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xe, params["gate"])) * jnp.einsum(
        "ecd,edf->ecf", xe, params["up"])
    return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", h, params["down"]))


def gshard_step(w, K):
    T, E = w["x"].shape[0], w["router"].shape[1]
    capacity = math.ceil(T * K / E)
    params = {k: jnp.asarray(w[k]) for k in ("router", "gate", "up", "down")}

    @jax.jit
    def step(params, x):
        return jax.value_and_grad(lambda p, x: jnp.sum(gshard_layer(p, x, K, capacity)),
                                  argnums=(0, 1))(params, x)
    x = jnp.asarray(w["x"])
    return lambda: step(params, x)


def hf_block(kind: str, w, K: int, implementation: str):
    """The transformers 5 MoE block ``kind`` ("mixtral": ``MixtralSparseMoeBlock``;
    "gpt_oss": ``GptOssMLP``, clamped SwiGLU with expert biases; "llama4_text":
    ``Llama4TextMoe``, input-side weights and a shared expert) with experts
    implementation ``implementation`` (Llama 4's experts have one: a bmm over all
    experts), float32, or None when torch or transformers is missing. Mixtral holds
    ``w``'s weights; the others draw theirs (N(0, 1/fan-in), biases N(0, 0.01)) with
    ``w``'s router row 0 (the Zipf load's skew)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    (D, E), F = w["router"].shape, w["gate"].shape[2]
    common = dict(hidden_size=D, intermediate_size=F, num_local_experts=E,
                  num_experts_per_tok=K)
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        block = MixtralSparseMoeBlock(transformers.MixtralConfig(
            **common, experts_implementation=implementation)).float()
        with torch.no_grad():
            block.gate.weight.copy_(torch.from_numpy(w["router"].T.copy()))
            block.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate(
                [w["gate"], w["up"]], axis=2).transpose(0, 2, 1).copy()))
            block.experts.down_proj.copy_(torch.from_numpy(w["down"].transpose(0, 2, 1).copy()))
        return block
    if kind == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
        block = GptOssMLP(transformers.GptOssConfig(
            **common, experts_implementation=implementation)).float()
    elif kind == "llama4_text":
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
        block = Llama4TextMoe(transformers.Llama4TextConfig(
            **common, intermediate_size_mlp=F)).float()
    else:
        raise ValueError(f"--block {kind!r}: choose one of {BLOCKS}")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in block.named_parameters():
            scale = 0.1 if "bias" in name else param.shape[1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
        block.router.weight[:, 0] = torch.from_numpy(w["router"][0])
    return block


def hf_step(block, w):
    """Forward + backward of the HF block on x = w["x"] (the loss: the sum of y)."""
    import torch
    torch.set_num_threads(os.cpu_count())
    x = torch.from_numpy(w["x"]).unsqueeze(0).requires_grad_()

    def step():
        block.zero_grad(set_to_none=True)
        x.grad = None
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return step


def interleaved(steps: dict, rounds: int) -> dict[str, list[float]]:
    """Each step's wall times (s) over ``rounds`` interleaved rounds: each step once per
    round, timed on the second of two back-to-back calls. The untimed call first: the
    call after another contender's pays for the memory that one gave back (on this
    project's VM, 150+ ms of system time after GShard's GBs); a training loop runs its
    step back to back."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            jax.block_until_ready(step())
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            times[name].append(time.perf_counter() - t0)
    return times


def bench(T, D, F, E, K, load, rounds, with_hf, block: str = "mixtral") -> dict:
    w = weights(T, D, F, E, load)
    layer = None
    if block != "mixtral":  # the layer computing the HF block, from its weights
        layer = MoE.from_hf(hf_block(block, w, K, "eager"), rngs=nnx.Rngs(0))
    steps = {"aristax.MoE": aristax_step(w, K, layer=layer),
             "aristax.MoE unfused": aristax_step(w, K, layer=layer, traced_in=unfused_default),
             "dense_mlp (ceiling)": dense_step(w, K),
             "dense_mlp_expert_shape": dense_step(w, K, expert_shape=True)}
    if block == "mixtral":  # GShard's einsum layer is Mixtral's routing and experts
        steps["gshard_einsum"] = gshard_step(w, K)
    if with_hf:
        for impl in ("eager",) if block == "llama4_text" else ("eager", "grouped_mm"):
            hf = hf_block(block, w, K, impl)
            if hf is not None:
                steps[f"hf_{impl}"] = hf_step(hf, w)
    for step in steps.values():  # compile and warm up
        jax.block_until_ready(step())
    times = interleaved(steps, rounds)
    ours = np.array(times["aristax.MoE"])
    row = {"block": block, "shape": dict(T=T, D=D, F=F, E=E, K=K), "load": load,
           "rounds": rounds,
           "median_ms": {n: 1e3 * float(np.median(t)) for n, t in times.items()},
           "ours_over": {n: float(np.median(ours / np.array(t)))
                         for n, t in times.items() if n != "aristax.MoE"}}
    print(f"{block} T{T} D{D} F{F} E{E} K{K} {load:7s} " + "  ".join(
        f"{n} {ms:7.0f} ms" for n, ms in row["median_ms"].items()))
    print("    aristax time over: " + "  ".join(f"{n} x{r:.2f}" for n, r in row["ours_over"].items()))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="T,D,F,E,K;... ")
    parser.add_argument("--loads", default="uniform,zipf")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--block", default="mixtral", choices=BLOCKS,
                        help="the HF block computed (and its peers)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 5 or min(s) < 1 for s in shapes):
        parser.error(f"--shapes {args.shapes!r}: give T,D,F,E,K of positive integers, "
                     "shapes separated by ';'")
    loads = args.loads.split(",")
    if not set(loads) <= {"uniform", "zipf"}:
        parser.error(f"--loads {args.loads!r}: choose from uniform,zipf")
    name = "moe_layer" if args.block == "mixtral" else f"moe_layer_{args.block}"
    out = Path(args.out or Path(__file__).resolve().parent / "results"
               / f"{name}_{jax.default_backend()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "dtype": "float32", "rows": []}
    for T, D, F, E, K in shapes:
        for load in loads:
            result["rows"].append(bench(T, D, F, E, K, load, args.rounds, not args.no_hf,
                                        args.block))
            out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
