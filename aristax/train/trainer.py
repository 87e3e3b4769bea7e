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

import contextlib
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
from jax.sharding import NamedSharding
from omegaconf import OmegaConf

from aristax.layers import layouts_checked
from aristax.models.mixtral import Mixtral
from aristax.parallel.measure import matmul_flops
from aristax.train import data as data_lib
from aristax.train.checkpoint import Checkpointer, checksum
from aristax.train.config import ConfigError, TrainConfig, mixtral_config, moe_config
from aristax.train.metrics import MetricsWriter, plot_run
from aristax.train.parallel_setup import batch_sharding, plan_and_mesh, start_processes
from aristax.train.run_control import Preemption, check_free_space, run_lock


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
               # expert choice: tokens no expert picked (y = 0); 0 for token choice
               "unchosen_fraction": jnp.mean(jnp.stack([a["unchosen_tokens"]
                                                        for a in out.moe_aux]))
               / (tokens.shape[0] * (tokens.shape[1] - 1)),
               "expert_load": jnp.stack([a["expert_load"] for a in out.moe_aux])}
    return ce + aux, metrics


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The learning rate of update n (0-based: step n + 1): linear warm-up from 0 over
    ``optim.warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``. A
    run of ``steps`` <= ``warmup_steps`` stays in the warm-up (update n at
    ``lr * n / warmup_steps``), so resuming it with more steps continues the same ramp."""
    o = cfg.optim
    return optax.warmup_cosine_decay_schedule(
        0.0, o.lr, o.warmup_steps, max(cfg.steps, o.warmup_steps + 1), o.lr * o.min_lr_ratio)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    o = cfg.optim
    return optax.chain(optax.clip_by_global_norm(o.clip_norm),
                       optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2,
                                   weight_decay=o.weight_decay))


def flops_per_token(cfg: TrainConfig, vocab_size: int | None = None) -> float:
    """Training FLOPs per token: 6 x the weights one token's forward multiplies by
    (attention projections; per MoE block the router, its top_k experts and the shared
    experts with their gate; the LM head) + 12 L D S (attention scores).
    ``vocab_size``: the model's (default ``model.vocab_size``)."""
    m, moe = cfg.model, moe_config(cfg.model)
    head_dim = m.d_model // m.num_heads
    attn = m.d_model * head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    mats = 3 if moe.gated else 2  # gate (when the activation has one), up, down
    ffn = (mats * m.d_model * (m.top_k * m.d_ff + moe.shared_width)
           + m.d_model * (m.num_experts + moe.shared_expert_gate))
    vocab = vocab_size or m.vocab_size or 256
    active = m.num_layers * (attn + ffn) + m.d_model * vocab
    return 6.0 * active + 12.0 * m.num_layers * m.d_model * m.seq_len


# ------------------------------------------------------------------ set-up
def build_model(cfg: TrainConfig, vocab_size: int, mesh, plan) -> Mixtral:
    return Mixtral(mixtral_config(cfg.model, vocab_size), rngs=nnx.Rngs(cfg.seed),
                   moe_config=moe_config(cfg.model, cfg.parallel), mesh=mesh, plan=plan)


def shard_module(module, mesh) -> None:
    """Put every array of ``module`` (a model or its optimizer) on ``mesh`` by its
    sharding metadata (experts over the plan mesh's expert axes, which ``MoE(plan=)``
    writes there; the rest replicated)."""
    if mesh is None:
        return
    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)
    nnx.update(module, jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                    state, specs))


def _global_batch(local: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(local)
    return jax.make_array_from_process_local_data(sharding, local)


def _place_like(saved, template):
    if not isinstance(template, jax.Array):
        return saved
    if jax.dtypes.issubdtype(template.dtype, jax.dtypes.prng_key):  # e.g. router jitter's
        return jax.device_put(saved, template.sharding)
    return jax.device_put(np.asarray(saved).astype(template.dtype), template.sharding)


def _state_dict(model, optimizer) -> dict:
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


# ------------------------------------------------------------------ checks
# config keys a resumed run may change; every other model.*, data.* and optim.* key
# must equal the checkpointed run's
RESUMABLE_CHANGES = ("model.implementation",
                     "data.source")  # the tokens' checksum decides (_check_same_data)


def check_batch_split(cfg: TrainConfig, mesh, num_processes: int) -> None:
    """The global batch's rows are split over the processes and every mesh device."""
    if num_processes > 1 and mesh is None:
        raise ConfigError(f"{num_processes} processes train one model only through the "
                          "expert-parallel mesh; set parallel.expert_parallel=true or run "
                          "one process")
    shards = num_processes if mesh is None else mesh.size
    if cfg.data.batch_size % shards:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} must be a multiple of the "
                          f"{shards} {'devices of the mesh' if mesh is not None else 'processes'}"
                          f" that split the batch rows, e.g. data.batch_size="
                          f"{-(-cfg.data.batch_size // shards) * shards}")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run_identity(cfg: TrainConfig) -> dict[str, Any]:
    """The model.*, data.* and optim.* keys (dotted) a checkpoint records, which a
    resumed run must keep."""
    full = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    flat = _flat({k: full[k] for k in ("model", "data", "optim")})
    return {k: v for k, v in flat.items() if k not in RESUMABLE_CHANGES}


def model_vocab(cfg: TrainConfig, data_vocab: int, saved_vocab: int | None = None) -> int:
    """The model's vocabulary: ``model.vocab_size``, else the resumed checkpoint's
    ``saved_vocab`` (the data's when it was written), else the data's ``data_vocab``
    (bytes: 256, a tokenizer's, a token array's max id + 1); ConfigError when the
    vocabulary is smaller than the data needs."""
    size = cfg.model.vocab_size
    if size is None and saved_vocab is not None:
        if saved_vocab < data_vocab:
            raise ConfigError(f"data.source={cfg.data.source!r} now needs a vocabulary of "
                              f"{data_vocab} (its largest token id + 1, or its tokenizer's) "
                              f"but the checkpointed run's model has {saved_vocab}, which "
                              "a resume cannot widen: resume on ids below it")
        return saved_vocab
    if size is None:
        return data_vocab
    if size < data_vocab:
        raise ConfigError(f"model.vocab_size={size} but data.source={cfg.data.source!r} needs "
                          f"{data_vocab} (its largest token id + 1, or its tokenizer's "
                          f"vocabulary): set model.vocab_size >= {data_vocab}, or leave it "
                          "unset to take the data's")
    return size


def data_fingerprint(cfg: TrainConfig, tokens: np.ndarray, vocab: int) -> dict:
    """What a checkpoint records of its training data: the source, a checksum of its
    token ids and the model's vocabulary on them."""
    return {"source": cfg.data.source, "checksum": checksum(tokens), "vocab": vocab}


def _resume_step(cfg: TrainConfig, ckpt: Checkpointer) -> int | None:
    """The checkpoint step the run continues from (None: a fresh run), checked
    against what ``out_dir`` holds."""
    latest = ckpt.latest_step()
    if not cfg.checkpoint.resume:
        if latest is not None:
            raise ConfigError(f"out_dir={cfg.out_dir} already holds checkpoints (latest step "
                              f"{latest}); continue that run with checkpoint.resume=true, or "
                              "start a new one with another out_dir= or name=")
        return None
    if latest is None:
        raise ConfigError(f"checkpoint.resume=true but out_dir={cfg.out_dir} holds no "
                          "checkpoint; run without it first")
    step = latest if cfg.checkpoint.step is None else cfg.checkpoint.step
    if step not in ckpt.all_steps():
        raise ConfigError(f"checkpoint.step={step}: out_dir={cfg.out_dir} holds the steps "
                          f"{ckpt.all_steps()}; pick one of them")
    if step >= cfg.steps:
        raise ConfigError(f"the run in {cfg.out_dir} is at step {step} and steps="
                          f"{cfg.steps}: nothing to train; raise steps= to continue it")
    return step


def _check_same_data(cfg: TrainConfig, meta: dict, fingerprint: dict[str, str]) -> None:
    """ConfigError when the checkpoint's data fingerprint differs from ``fingerprint``
    (unless ``checkpoint.accept_changed_data``)."""
    saved = meta.get("data")
    if (saved is None or saved["checksum"] == fingerprint["checksum"]
            or cfg.checkpoint.accept_changed_data):
        return
    raise ConfigError(
        f"data.source={cfg.data.source!r} now holds other tokens than the checkpointed run "
        f"trained on ({saved['source']!r}, checksum {saved['checksum']} -> "
        f"{fingerprint['checksum']}); resume on the same data, or set "
        "checkpoint.accept_changed_data=true to continue on these")


def resumed_meta(cfg: TrainConfig, ckpt: Checkpointer) -> dict | None:
    """The meta of the checkpoint the run continues from (``_resume_step``), None for
    a fresh run."""
    step = _resume_step(cfg, ckpt)
    return None if step is None else ckpt.meta(step)


def start_step_and_data(cfg: TrainConfig, ckpt: Checkpointer, model, optimizer,
                        fingerprint: dict, meta: dict | None):
    """(first step, data iterator state, later checkpoints deleted, the checkpointed
    run's ``steps``) of the run: 0, None, [], None for a fresh run (``meta`` None);
    else the checkpoint's of ``meta`` (``resumed_meta``), restored into ``model`` and
    ``optimizer`` after checking it belongs to this config and data, and verifying
    its checksums."""
    if meta is None:
        return 0, None, [], None
    step = int(meta["step"])
    saved = meta.get("config")
    if saved is not None:
        now = run_identity(cfg)
        changed = sorted(k for k in set(saved) | set(now)
                         if saved.get(k) != now.get(k) and k not in RESUMABLE_CHANGES)
        if changed:
            raise ConfigError(
                "checkpoint.resume=true with another config than the checkpointed run's: "
                + ", ".join(f"{k}={now.get(k)!r} (was {saved.get(k)!r})" for k in changed)
                + "; resume with its values (steps, logging, eval, checkpoint and "
                "parallel.* may change)")
    _check_same_data(cfg, meta, fingerprint)
    state, data_state, meta = ckpt.restore(_state_dict(model, optimizer), _place_like, step)
    _restore_pure(model, optimizer, state)
    return int(meta["step"]), data_state, ckpt.delete_after(step), meta.get("steps")


# ------------------------------------------------------------------ the run
@dataclasses.dataclass
class _Run:
    """What one process of a run holds from set-up to summary."""

    cfg: TrainConfig
    proc: int  # this process's index
    nproc: int  # process count
    out_dir: Path
    devices: list
    plan: Any  # the planner's Plan, or None without expert parallelism
    mesh: Any  # jax Mesh, or None on one device
    options: dict  # the first MoE block's plan call options (exchange, chunks, perm)
    vocab: int
    train_tokens: np.ndarray
    held_out: np.ndarray
    model: Mixtral
    optimizer: nnx.Optimizer
    ckpt: Checkpointer
    start_step: int
    stream: Any  # data_lib.batches iterator of this process's rows
    sharding: Any  # of a global batch, None without a mesh
    fingerprint: dict  # of the training data (``data_fingerprint``)
    deleted: list  # checkpoint steps after the resumed one, deleted at set-up
    saved_steps: int | None  # the resumed run's ``steps`` (None: fresh, or not recorded)

    @property
    def main(self) -> bool:
        return self.proc == 0

    @property
    def local_batch(self) -> int:
        return self.cfg.data.batch_size // self.nproc

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.data.batch_size * self.cfg.model.seq_len


def _set_up(cfg: TrainConfig) -> _Run:
    """Plan and mesh, data, the sharded model and optimizer (checked to fit the disk
    twice over), restored from a checkpoint when resuming. The processes are started
    (``start_processes``)."""
    proc, nproc = jax.process_index(), jax.process_count()
    devices = jax.devices()
    plan, mesh = plan_and_mesh(cfg, devices)
    m = cfg.model
    check_batch_split(cfg, mesh, nproc)
    tokens, data_vocab = data_lib.read_tokens(cfg.data, m.vocab_size or 0)
    ckpt = Checkpointer(Path(cfg.out_dir) / "checkpoints", keep=cfg.checkpoint.keep)
    meta = resumed_meta(cfg, ckpt)
    vocab = model_vocab(cfg, data_vocab, None if meta is None
                        else meta.get("data", {}).get("vocab"))
    train_tokens, held_out = data_lib.split(tokens, cfg.data.held_out_fraction, m.seq_len)
    model = build_model(cfg, vocab, mesh, plan)
    optimizer = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    shard_module(model, mesh)
    shard_module(optimizer, mesh)
    options = model.layers[0].moe.plan_call_options(cfg.data.batch_size * m.seq_len) or {}
    if proc == 0:
        check_free_space(Path(cfg.out_dir), sum(
            getattr(a, "nbytes", 0) for a in jax.tree.leaves(_state_dict(model, optimizer))))
    ckpt.expert_perm = options.get("expert_perm")
    fingerprint = data_fingerprint(cfg, tokens, vocab)
    start_step, data_state, deleted, saved_steps = start_step_and_data(
        cfg, ckpt, model, optimizer, fingerprint, meta)
    stream = data_lib.batches(train_tokens, m.seq_len, cfg.data.batch_size // nproc,
                              seed=cfg.data.seed, process_index=proc, process_count=nproc,
                              state=data_state)
    return _Run(cfg=cfg, proc=proc, nproc=nproc, out_dir=Path(cfg.out_dir), devices=devices,
                plan=plan, mesh=mesh, options=options, vocab=vocab,
                train_tokens=train_tokens, held_out=held_out, model=model,
                optimizer=optimizer, ckpt=ckpt, start_step=start_step, stream=stream,
                sharding=batch_sharding(mesh), fingerprint=fingerprint, deleted=deleted,
                saved_steps=saved_steps)


def make_steps(bias_update: bool):
    """(train_step(model, optimizer, tokens) -> metrics, eval_step(model, tokens) ->
    loss), ``nnx.jit``-compiled; the train step also moves the MoE blocks' balance
    biases when ``bias_update`` (aux-loss-free balancing). The eval step runs the model
    deterministic (``nnx.view``): no router or input jitter, no draws from its streams,
    so evaluating changes neither the held-out loss nor the training that follows."""

    @nnx.jit
    def train_step(model, optimizer, tokens):
        (_, metrics), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, tokens)
        optimizer.update(model, grads)
        if bias_update:
            for layer, load in zip(model.layers, metrics["expert_load"]):
                layer.moe.update_balance_bias(load)
        return metrics

    @nnx.jit
    def eval_step(model, tokens):  # no jitter: it neither shifts the loss nor draws keys
        return lm_loss(nnx.view(model, deterministic=True), tokens)[1]["loss"]
    return train_step, eval_step


def _evaluate(run: _Run, eval_step) -> float:
    """Mean held-out loss over ``eval_batches`` batches, from the held-out start."""
    it = data_lib.batches(run.held_out, run.cfg.model.seq_len, run.local_batch, seed=0,
                          shuffle=False, process_index=run.proc, process_count=run.nproc)
    return float(np.mean([eval_step(run.model, _global_batch(next(it), run.sharding))
                          for _ in range(run.cfg.eval_batches)]))


def unused_parallel_keys(cfg: TrainConfig) -> list[str]:
    """The parallel.* settings, away from their defaults, that only expert parallelism
    reads (its topology, plan and exchange), as "key=value"."""
    keys = ("topology", "expert_capacity", "group_size", "exchange")
    return [f"parallel.{f.name}={getattr(cfg.parallel, f.name)!r}"
            for f in dataclasses.fields(cfg.parallel)
            if f.name in keys and getattr(cfg.parallel, f.name) != f.default]


def _announce(run: _Run, log) -> None:
    """Writes config.yaml and plan.json and logs the run (main process only)."""
    cfg, m, mesh, options = run.cfg, run.cfg.model, run.mesh, run.options
    if not run.main:
        return
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if run.plan is not None:
        (run.out_dir / "plan.json").write_text(run.plan.to_json(indent=1))
    mesh_text = "one device" if mesh is None else (
        f"mesh {dict(mesh.shape)} from the plan, exchange {options.get('exchange')}, "
        f"{options.get('num_chunks')} Lancet chunk(s)")
    log(f"aristax train {cfg.name}: {m.num_layers}-layer MoE LM, {m.num_experts} experts "
        f"(top-{m.top_k}, {m.router}), d_model {m.d_model}; {len(run.train_tokens):,} "
        f"training tokens from {cfg.data.source}; {len(run.devices)} devices in "
        f"{run.nproc} process(es), {mesh_text}; steps {run.start_step + 1}..{cfg.steps}")
    unused = unused_parallel_keys(cfg) if run.plan is None else []
    if unused:
        why = ("parallel.expert_parallel=false" if not cfg.parallel.expert_parallel
               else "one device")
        log(f"note: {', '.join(unused)} shape expert parallelism, which this run does not "
            f"use ({why}): they have no effect")
    windows, wanted = (len(run.held_out) - 1) // m.seq_len, cfg.eval_batches * cfg.data.batch_size
    if wanted > windows:
        log(f"note: eval_batches={cfg.eval_batches} x data.batch_size={cfg.data.batch_size} = "
            f"{wanted} held-out windows, and the held-out split has {windows}: some count more "
            "than once (lower eval_batches or raise data.held_out_fraction)")
    if run.deleted:
        log(f"resumed from step {run.start_step}: deleted the later checkpoints {run.deleted}, "
            "which this run writes anew")
    if run.saved_steps not in (None, cfg.steps):
        before = dataclasses.replace(cfg, steps=run.saved_steps)
        log(f"resumed with steps={cfg.steps}, the checkpointed run had steps="
            f"{run.saved_steps}: the learning-rate schedule now spans {cfg.steps} steps "
            f"(step {run.start_step + 1}: lr {float(lr_schedule(cfg)(run.start_step)):.3g}, "
            f"{float(lr_schedule(before)(run.start_step)):.3g} on the old schedule)")


def step_row(step: int, metrics: dict, seconds: float, tokens_per_step: int,
             flops_per_tok: float, peak: float, lr: float) -> dict[str, Any]:
    """The metrics row of one step (host values of ``lm_loss``'s metrics, and the
    learning rate ``lr`` it updated with); tokens/s and MFU from its ``seconds``."""
    rate = tokens_per_step / max(seconds, 1e-9)
    return {"step": step, "loss": float(metrics["loss"]), "lr": lr,
            "aux_loss": float(metrics["aux_loss"]), "tokens_per_s": rate,
            "mfu": rate * flops_per_tok / peak,
            "dropped_fraction": float(metrics["dropped_fraction"]),
            "unchosen_fraction": float(metrics["unchosen_fraction"]),
            "router_entropy": float(metrics["router_entropy"]),
            "expert_load": np.asarray(metrics["expert_load"]).tolist()}


@jax.jit
def _all_finite(params) -> jax.Array:
    """Whether every floating array of ``params`` is finite."""
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(params)
                                if jnp.issubdtype(a.dtype, jnp.inexact)]))


def _save(run: _Run, step: int) -> None:
    """Checkpoint ``step``, unless the parameters are no longer finite (then
    FloatingPointError: the latest finite checkpoint stays the latest)."""
    if not bool(_all_finite(nnx.state(run.model, nnx.Param))):
        raise FloatingPointError(
            f"step {step}: the parameters are no longer finite; no checkpoint written (the "
            f"latest, step {run.ckpt.latest_step()}, stays); lower optim.lr or raise "
            "optim.warmup_steps and resume from it")
    run.ckpt.save(step, _state_dict(run.model, run.optimizer), run.stream.get_state(),
                  {"name": run.cfg.name, "config": run_identity(run.cfg),
                   "data": run.fingerprint, "steps": run.cfg.steps})


def _train_loop(run: _Run, writer: MetricsWriter, row_of, log, preemption: Preemption
                ) -> tuple[list[float], list[tuple[int, float]], list[float], int | None]:
    """Steps ``start_step + 1 .. steps``: logs, evaluates and checkpoints on schedule,
    checks each finished checkpoint (``Checkpointer.poll``), and stops after a
    checkpoint at the step ``preemption`` names. ``row_of(step, metrics, seconds)``
    makes a step's row. Returns (losses, (step, held-out loss) pairs, seconds of each
    step: data + step, without evaluation and checkpoints, the step it stopped at on
    a preemption notice or None)."""
    cfg = run.cfg
    train_step, eval_step = make_steps(cfg.model.bias_update_rate > 0)
    losses, evals, step_s = [], [], []
    with progress_display(cfg, run.main, run.start_step) as progress:
        for step in range(run.start_step + 1, cfg.steps + 1):
            run.ckpt.poll()
            t0 = time.perf_counter()
            batch = _global_batch(next(run.stream), run.sharding)
            metrics = jax.device_get(train_step(run.model, run.optimizer, batch))
            step_s.append(time.perf_counter() - t0)
            row = row_of(step, metrics, step_s[-1])
            writer.write(row)
            if not np.isfinite(row["loss"]):
                raise FloatingPointError(f"step {step}: the training loss is {row['loss']}; "
                                         "lower optim.lr or raise optim.warmup_steps")
            losses.append(row["loss"])
            progress(step, row, log)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                evals.append((step, _evaluate(run, eval_step)))
                writer.write({"step": step, "eval_loss": evals[-1][1]})
                if run.main:
                    log(f"step {step}: held-out loss {evals[-1][1]:.3f}")
            preempted = preemption.reached(step)
            if preempted or step % cfg.checkpoint.every == 0 or step == cfg.steps:
                _save(run, step)
            if preempted:
                return losses, evals, step_s, step
        return losses, evals, step_s, None


def _summary(run: _Run, evals, step_s, rows) -> dict[str, Any]:
    """summary.json's content (without the plots) from the run's (step, held-out loss)
    pairs, step seconds and metrics rows. The losses and drop fractions cover every
    step in ``rows`` (on the main process, a resumed run's earlier steps too, as
    metrics.jsonl keeps them); the timings, ``first_step`` on, this process's steps."""
    steady = step_s[1:]  # the first step compiles
    train = [r for r in rows if "loss" in r]
    out_dir = run.out_dir
    return {"name": run.cfg.name, "steps": run.cfg.steps, "first_step": run.start_step + 1,
            "final_loss": float(np.mean([r["loss"] for r in train[-10:]])),
            "first_loss": train[0]["loss"],
            "eval_loss": evals[-1][1],
            "tokens_per_s": (len(steady) * run.tokens_per_step / sum(steady)) if steady
            else None,  # one step: only the compiling one
            "first_step_s": step_s[0],
            "dropped_fraction": float(np.mean([r["dropped_fraction"] for r in train])),
            "unchosen_fraction": float(np.mean([r.get("unchosen_fraction", 0.0)
                                                for r in train])),
            "devices": len(run.devices), "processes": run.nproc,
            "mesh": None if run.mesh is None else dict(run.mesh.shape),
            "out_dir": str(out_dir), "checkpoints": str(out_dir / "checkpoints"),
            "metrics": str(out_dir / "metrics.jsonl"),
            "tensorboard": str(out_dir / "tensorboard")}


def _report(out_dir: Path, summary: dict[str, Any], rows, log) -> None:
    """Plots, summary.json and the closing log lines (main process)."""
    summary["plots"] = [str(p) for p in plot_run(rows, out_dir)]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"done: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
        f"(last 10 steps), held-out {summary['eval_loss']:.3f}, "
        + (f"{summary['tokens_per_s']:,.0f} tokens/s after the first step "
           if summary["tokens_per_s"] else "no step after the first to time ")
        + f"({summary['first_step_s']:.1f} s with compilation), "
        f"{100 * summary['dropped_fraction']:.1f}% of expert assignments dropped"
        + (f", {100 * summary['unchosen_fraction']:.1f}% of tokens chosen by no expert "
           "(expert choice)" if summary["unchosen_fraction"] else ""))
    log(f"checkpoints: {summary['checkpoints']}\nmetrics: {summary['metrics']} "
        f"(TensorBoard: {summary['tensorboard']})\nplots: {', '.join(summary['plots'])}\n"
        f"summary: {out_dir / 'summary.json'}")


def train(cfg: TrainConfig, *, log=print) -> RunResult:
    """Run ``cfg`` (see the module docstring); returns losses and the summary. Process
    0 holds ``out_dir``'s run lock for the run's life (``RunLocked`` if another run
    holds it)."""
    start_processes(cfg)
    with run_lock(Path(cfg.out_dir), enabled=jax.process_index() == 0):
        preemption = Preemption()
        try:
            return _run(cfg, log, preemption)
        finally:
            preemption.close()


def _run(cfg: TrainConfig, log, preemption: Preemption) -> RunResult:
    """``train``'s body, once the processes are up and the run lock is held."""
    run = _set_up(cfg)
    writer = MetricsWriter(run.out_dir, enabled=run.main, start_step=run.start_step)
    device = run.devices[0]
    peak = matmul_flops(device, jnp.dtype(cfg.model.dtype)) * (
        1 if device.platform == "cpu" else len(run.devices))
    fpt = flops_per_token(cfg, run.vocab)
    schedule = lr_schedule(cfg)
    _announce(run, log)

    def row_of(step, metrics, seconds):
        return step_row(step, metrics, seconds, run.tokens_per_step, fpt, peak,
                        float(schedule(step - 1)))

    try:
        # layouts checked once: the steps compile without the check's host callback,
        # so JAX's persistent compilation cache (when set) keeps them
        with layouts_checked(run.model):
            losses, evals, step_s, stopped = _train_loop(run, writer, row_of, log, preemption)
        run.ckpt.wait()
    finally:
        writer.close()
        run.ckpt.close()
    if stopped is not None:
        if run.main:
            log(f"aristax train: stopped by {preemption.name} after step {stopped}; checkpoint "
                f"saved in "
                f"{run.out_dir / 'checkpoints' / str(stopped)}; continue with "
                "checkpoint.resume=true")
        return RunResult(losses, evals, run.out_dir, {"stopped_at": stopped})
    summary = _summary(run, evals, step_s, writer.rows)
    if run.nproc > 1:  # every process's view of the global loss: they must agree
        log(f"process {run.proc} losses {json.dumps(losses)}")
    if run.main:
        _report(run.out_dir, summary, writer.rows, log)
    return RunResult(losses, evals, run.out_dir, summary)


def _restore_pure(model, optimizer, state) -> None:
    for module, pure in ((model, state["model"]), (optimizer, state["optimizer"])):
        current = nnx.state(module)
        nnx.replace_by_pure_dict(current, pure)
        nnx.update(module, current)


@contextlib.contextmanager
def progress_display(cfg: TrainConfig, main: bool, start_step: int):
    """Yields ``update(step, row, log)``: a rich progress bar (loss, tokens/s) on a
    terminal, stopped (its cursor shown again) however the loop ends; plain lines
    every ``log_every`` steps otherwise."""
    if main and cfg.progress and sys.stdout.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                       TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        task = bar.add_task("train", total=cfg.steps, completed=start_step, info="")

        def update(step, row, log):
            bar.update(task, completed=step, info=f"loss {row['loss']:.3f}  "
                       f"{row['tokens_per_s']:,.0f} tok/s  dropped {row['dropped_fraction']:.3f}")
        with bar:
            yield update
        return

    def lines(step, row, log):
        if main and (step % cfg.log_every == 0 or step == cfg.steps):
            log(f"step {step:5d}  loss {row['loss']:.3f}  aux {row['aux_loss']:.4f}  "
                f"{row['tokens_per_s']:,.0f} tokens/s  MFU {100 * row['mfu']:.1f}%  "
                f"dropped {row['dropped_fraction']:.3f}  router entropy "
                f"{row['router_entropy']:.2f}")
    yield lines
