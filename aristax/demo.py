"""``aristax demo``: train a small Mixtral-style MoE language model on local text.

The text is the Python standard library's own source files (on every machine with
Python), read as bytes (vocabulary 256). The demo prints the training loss falling,
the held-out loss, and how many tokens each expert received.
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from aristax.models.mixtral import Mixtral, MixtralConfig


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """uint8[N]: the standard library's .py files, in sorted path order, up to N bytes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(np.frombuffer(data, np.uint8))
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under {root}: pass --text-dir instead")
    return np.concatenate(chunks)[:max_bytes]


def text_dir_bytes(directory: str, max_bytes: int) -> np.ndarray:
    """uint8[N]: every file under ``directory`` (sorted), concatenated, up to N bytes."""
    files = sorted(p for p in pathlib.Path(directory).rglob("*") if p.is_file())
    if not files:
        raise FileNotFoundError(f"--text-dir {directory!r} holds no files")
    data = b"".join(p.read_bytes() for p in files)[:max_bytes]
    return np.frombuffer(data, np.uint8)


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    """Endless random windows: int32[batch, seq + 1] (inputs and shifted targets)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, batch)
        yield np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)


def lm_loss(model: Mixtral, tokens: jax.Array) -> tuple[jax.Array, tuple]:
    """Next-byte cross-entropy plus the router's load-balancing loss."""
    out = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, tokens[:, 1:]).mean()
    return ce + model.config.router_aux_loss_coef * out.aux_loss, (ce, out.router_logits)


def expert_load(router_logits, top_k: int) -> np.ndarray:
    """int[L, E]: tokens routed to each expert in each layer (top-k of the logits)."""
    return np.stack([
        np.bincount(np.asarray(jax.lax.top_k(lg, top_k)[1]).ravel(), minlength=lg.shape[-1])
        for lg in router_logits
    ])


def run(args: argparse.Namespace) -> dict:
    cfg = MixtralConfig(
        vocab_size=256, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=args.experts, num_experts_per_tok=2, rope_theta=10000.0,
        max_position_embeddings=args.seq, router_aux_loss_coef=0.01,
        bos_token_id=None, eos_token_id=None,
    )
    data = (text_dir_bytes(args.text_dir, args.max_bytes) if args.text_dir
            else stdlib_bytes(args.max_bytes))
    split = int(0.95 * len(data))
    train, held_out = data[:split], data[split:]
    model = Mixtral(cfg, rngs=nnx.Rngs(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 20, args.steps, args.lr / 10)
    optimizer = nnx.Optimizer(model, optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        (loss, (ce, logits)), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, tokens)
        optimizer.update(model, grads)
        return ce, logits

    eval_step = nnx.jit(lambda model, tokens: lm_loss(model, tokens)[1][0])
    print(f"aristax demo: {args.layers}-layer Mixtral-style MoE, {args.experts} experts "
          f"(top-2), d_model {args.d_model}, {len(train):,} training bytes of "
          f"{'--text-dir' if args.text_dir else 'Python stdlib source'}; {args.steps} steps "
          f"of {args.batch}x{args.seq} bytes", flush=True)
    stream = batches(train, args.batch, args.seq, args.seed)
    start, history, load = time.perf_counter(), [], None
    for step in range(1, args.steps + 1):
        ce, router_logits = train_step(model, optimizer, jnp.asarray(next(stream)))
        history.append(float(ce))
        if step % args.log_every == 0 or step == args.steps:
            load = expert_load(router_logits, 2)
            rate = step * args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {np.mean(history[-args.log_every:]):.3f} "
                  f"(bits/byte {np.mean(history[-args.log_every:]) / np.log(2):.2f})  "
                  f"{rate:,.0f} tokens/s", flush=True)
    eval_stream = batches(held_out, args.batch, args.seq, args.seed + 1)
    eval_loss = float(np.mean([eval_step(model, jnp.asarray(next(eval_stream)))
                               for _ in range(8)]))
    print(f"held-out loss {eval_loss:.3f}; first-10-step loss {np.mean(history[:10]):.3f}")
    print("tokens per expert in the last batch (rows: layers):")
    for i, row in enumerate(load):
        print(f"  layer {i}: " + " ".join(f"{n:5d}" for n in row))
    return {"losses": history, "eval_loss": eval_loss, "expert_load": load.tolist()}


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small MoE LM on local text (~1.5 min on 2 cores)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--text-dir", default=None, help="train on these files instead")
    p.set_defaults(func=run)
