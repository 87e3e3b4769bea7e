"""``aristax train``: a config -> plan -> mesh -> sharded model -> optax training loop.

One step: next-token cross-entropy of a decoder whose FFN blocks are
``aristax.MoE`` plus every MoE block's weighted aux loss (load balancing, sequence-
wise, z), AdamW with warmup/cosine and global-norm clipping, and the aux-loss-free
bias update when configured. Every step logs loss, tokens/s, an MFU estimate,
per-expert load, dropped fraction and router entropy; held-out loss every
``eval_every`` steps and at the end; checkpoints every ``checkpoint.every`` steps
and at the end; a summary and PNG plots at the end.

MFU estimate: model FLOPs per token (6 x active parameters + the attention score
terms, the usual training estimate) x tokens/s over a *measured* peak: the float32
(bfloat16 on GPU) matmul rate of one device, measured at start-up, times the number
of devices (on a CPU host, simulated devices share the cores, so the peak is one
device's).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from omegaconf import OmegaConf

from aristax.models.mixtral import Mixtral
from aristax.train import data as data_lib
from aristax.train.checkpoint import Checkpointer
from aristax.train.config import TrainConfig, mixtral_config, moe_config
from aristax.train.metrics import MetricsWriter, plot_run
from aristax.train.parallel_setup import (batch_sharding, param_sharding, plan_and_mesh,
                                          start_processes)


@dataclasses.dataclass
class RunResult:
    losses: list[float]
    eval_losses: list[tuple[int, float]]
    out_dir: Path
    summary: dict[str, Any]


# ------------------------------------------------------------------ pure pieces
def lm_loss(model: Mixtral, tokens: jax.Array):
    """(cross-entropy + sum of the MoE blocks' aux losses, metrics) for int[B, S+1]."""
    out = model(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(
        out.logits.astype(jnp.float32), tokens[:, 1:]).mean()
    aux = sum(a["loss"] for a in out.moe_aux)
    probs = [jax.nn.softmax(lg.astype(jnp.float32), axis=-1) for lg in out.router_logits]
    entropy = jnp.mean(jnp.stack([jnp.mean(-jnp.sum(p * jnp.log(p + 1e-9), axis=-1))
                                  for p in probs]))
    metrics = {"loss": ce, "aux_loss": aux, "router_entropy": entropy,
               "dropped_fraction": jnp.mean(jnp.stack([a["dropped_fraction"]
                                                       for a in out.moe_aux])),
               "expert_load": jnp.stack([a["expert_load"] for a in out.moe_aux])}
    return ce + aux, metrics


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    o = cfg.optim
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, o.lr, min(o.warmup_steps, cfg.steps), max(cfg.steps, o.warmup_steps + 1),
        o.lr * o.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm),
                       optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


def flops_per_token(cfg: TrainConfig) -> float:
    """6 x active parameters per token + 12 L D S (attention scores), training."""
    m = cfg.model
    head_dim = m.d_model // m.num_heads
    attn = m.d_model * head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    gated = 3 if m.activation in ("swiglu", "geglu") else 2
    ffn = gated * m.d_model * m.d_ff * (m.top_k + m.num_shared_experts)
    active = m.num_layers * (attn + ffn + m.d_model * m.num_experts) + m.d_model * m.vocab_size
    return 6.0 * active + 12.0 * m.num_layers * m.d_model * m.seq_len


def measured_peak_flops(dtype) -> float:
    """FLOP/s of a 1024^3 matmul on the default device (median of 5)."""
    a = jnp.ones((1024, 1024), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * 1024 ** 3 / float(np.median(times))


# ------------------------------------------------------------------ set-up
def build_model(cfg: TrainConfig, vocab_size: int, mesh, plan) -> Mixtral:
    return Mixtral(mixtral_config(cfg.model, vocab_size), rngs=nnx.Rngs(cfg.seed),
                   moe_config=moe_config(cfg.model, cfg.parallel), mesh=mesh, plan=plan)


def shard_module(module, mesh) -> None:
    """Put every array of ``module`` (a model or its optimizer) on ``mesh`` by its
    sharding metadata (experts over the expert axes; the rest replicated)."""
    if mesh is None:
        return
    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)
    nnx.update(module, jax.tree.map(lambda x, s: jax.device_put(x, param_sharding(mesh, s)),
                                    state, specs))


def _global_batch(local: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(local)
    return jax.make_array_from_process_local_data(sharding, local)


def _place_like(saved, template):
    if isinstance(template, jax.Array):
        return jax.device_put(np.asarray(saved).astype(template.dtype), template.sharding)
    return saved


def _state_dict(model, optimizer) -> dict:
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


# ------------------------------------------------------------------ the run
def train(cfg: TrainConfig, *, log=print) -> RunResult:
    """Run ``cfg`` (see the module docstring); returns losses and the summary."""
    start_processes(cfg)
    proc, nproc = jax.process_index(), jax.process_count()
    main = proc == 0
    out_dir = Path(cfg.out_dir)
    devices = jax.devices()
    plan, mesh = plan_and_mesh(cfg, devices)
    m = cfg.model
    if cfg.data.batch_size % nproc or (mesh is not None and
                                       (cfg.data.batch_size * m.seq_len) % len(devices)):
        raise ValueError(f"data.batch_size={cfg.data.batch_size} x model.seq_len={m.seq_len} "
                         f"must split evenly over {nproc} processes and {len(devices)} devices")
    tokens, vocab = data_lib.read_tokens(cfg.data)
    vocab = max(vocab, m.vocab_size)
    train_tokens, held_out = data_lib.split(tokens, cfg.data.held_out_fraction, m.seq_len)
    local_batch = cfg.data.batch_size // nproc
    model = build_model(cfg, vocab, mesh, plan)
    optimizer = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    shard_module(model, mesh)
    shard_module(optimizer, mesh)
    options = dict(model.layers[0].moe.ep_options or ())
    ckpt = Checkpointer(out_dir / "checkpoints", keep=cfg.checkpoint.keep,
                        expert_perm=options.get("expert_perm"))
    start_step, data_state = 0, None
    if cfg.checkpoint.resume:
        state, data_state, meta = ckpt.restore(_state_dict(model, optimizer), _place_like)
        _restore_pure(model, optimizer, state)
        start_step = int(meta["step"])
    stream = data_lib.batches(train_tokens, m.seq_len, local_batch, seed=cfg.data.seed,
                              process_index=proc, process_count=nproc, state=data_state)
    sharding = batch_sharding(mesh)
    bias_update = m.bias_update_rate > 0

    @nnx.jit
    def train_step(model, optimizer, tokens):
        (_, metrics), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, tokens)
        optimizer.update(model, grads)
        if bias_update:
            for layer, load in zip(model.layers, metrics["expert_load"]):
                layer.moe.update_balance_bias(load)
        return metrics

    eval_step = nnx.jit(lambda model, tokens: lm_loss(model, tokens)[1]["loss"])

    def evaluate():
        it = data_lib.batches(held_out, m.seq_len, local_batch, seed=0, shuffle=False,
                              process_index=proc, process_count=nproc)
        return float(np.mean([eval_step(model, _global_batch(next(it), sharding))
                              for _ in range(cfg.eval_batches)]))

    writer = MetricsWriter(out_dir, enabled=main, start_step=start_step)
    peak = measured_peak_flops(jnp.dtype(m.dtype)) * (1 if devices[0].platform == "cpu"
                                                       else len(devices))
    fpt = flops_per_token(cfg)
    tokens_per_step = cfg.data.batch_size * m.seq_len
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        if plan is not None:
            (out_dir / "plan.json").write_text(plan.to_json(indent=1))
        mesh_text = "one device" if mesh is None else (
            f"mesh {dict(mesh.shape)} from the plan, exchange {options.get('backend')}, "
            f"{options.get('num_chunks')} Lancet chunk(s)")
        log(f"aristax train {cfg.name}: {m.num_layers}-layer MoE LM, {m.num_experts} experts "
            f"(top-{m.top_k}, {m.router}), d_model {m.d_model}; {len(train_tokens):,} training "
            f"tokens from {cfg.data.source}; {len(devices)} devices in {nproc} process(es), "
            f"{mesh_text}; steps {start_step + 1}..{cfg.steps}")
    losses, evals = [], []
    progress = _progress(cfg, main, start_step)
    t_start, t_last = time.perf_counter(), time.perf_counter()
    for step in range(start_step + 1, cfg.steps + 1):
        metrics = jax.device_get(train_step(model, optimizer,
                                            _global_batch(next(stream), sharding)))
        now = time.perf_counter()
        rate = tokens_per_step / max(now - t_last, 1e-9)
        t_last = now
        row = {"step": step, "loss": float(metrics["loss"]),
               "aux_loss": float(metrics["aux_loss"]), "tokens_per_s": rate,
               "mfu": rate * fpt / peak, "dropped_fraction": float(metrics["dropped_fraction"]),
               "router_entropy": float(metrics["router_entropy"]),
               "expert_load": np.asarray(metrics["expert_load"]).tolist()}
        writer.write(row)
        losses.append(row["loss"])
        progress(step, row, log)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evals.append((step, evaluate()))
            writer.write({"step": step, "eval_loss": evals[-1][1]})
            if main:
                log(f"step {step}: held-out loss {evals[-1][1]:.3f}")
        if step % cfg.checkpoint.every == 0 or step == cfg.steps:
            ckpt.save(step, _state_dict(model, optimizer), stream.get_state(),
                      {"name": cfg.name})
    ckpt.wait()
    ckpt.close()
    elapsed = time.perf_counter() - t_start
    summary = {"name": cfg.name, "steps": cfg.steps, "first_step": start_step + 1,
               "final_loss": float(np.mean(losses[-10:])) if losses else None,
               "first_loss": losses[0] if losses else None,
               "eval_loss": evals[-1][1] if evals else None,
               "tokens_per_s": (len(losses) * tokens_per_step / elapsed) if losses else None,
               "devices": len(devices), "processes": nproc,
               "mesh": None if mesh is None else dict(mesh.shape),
               "out_dir": str(out_dir), "checkpoints": str(out_dir / "checkpoints"),
               "metrics": str(out_dir / "metrics.jsonl"),
               "tensorboard": str(out_dir / "tensorboard")}
    writer.close()
    if nproc > 1:  # every process's view of the global loss: they must agree
        log(f"process {proc} losses {json.dumps(losses)}")
    if main:
        summary["plots"] = [str(p) for p in plot_run(writer.rows, out_dir)]
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log(f"done: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
            f"(last 10 steps), held-out {summary['eval_loss']:.3f}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s")
        log(f"checkpoints: {summary['checkpoints']}\nmetrics: {summary['metrics']} "
            f"(TensorBoard: {summary['tensorboard']})\nplots: {', '.join(summary['plots'])}\n"
            f"summary: {out_dir / 'summary.json'}")
    return RunResult(losses, evals, out_dir, summary)


def _restore_pure(model, optimizer, state) -> None:
    for module, pure in ((model, state["model"]), (optimizer, state["optimizer"])):
        current = nnx.state(module)
        nnx.replace_by_pure_dict(current, pure)
        nnx.update(module, current)


def _progress(cfg: TrainConfig, main: bool, start_step: int):
    """A rich progress bar (loss, tokens/s) on a terminal; plain lines every
    ``log_every`` steps otherwise."""
    if main and cfg.progress and sys.stdout.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                       TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        task = bar.add_task("train", total=cfg.steps, completed=start_step, info="")
        bar.start()

        def update(step, row, log):
            bar.update(task, completed=step, info=f"loss {row['loss']:.3f}  "
                       f"{row['tokens_per_s']:,.0f} tok/s")
            if step == cfg.steps:
                bar.stop()
        return update

    def lines(step, row, log):
        if main and (step % cfg.log_every == 0 or step == cfg.steps):
            log(f"step {step:5d}  loss {row['loss']:.3f}  aux {row['aux_loss']:.4f}  "
                f"{row['tokens_per_s']:,.0f} tokens/s  MFU {100 * row['mfu']:.1f}%  "
                f"dropped {row['dropped_fraction']:.3f}  router entropy "
                f"{row['router_entropy']:.2f}")
    return lines
