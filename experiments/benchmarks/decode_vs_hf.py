"""Decode latency of aristax Mixtral vs Hugging Face eager, against a memory roofline.

TinyMistral-6x248M-sized model (hidden 1024, expert hidden 4096, 12 layers, 6 experts,
top-2, 32 heads, 8 KV heads, vocab 32000), random weights, float32, on this machine:

* batch 1, a 10-token prompt, 128 greedy new tokens: per-token decode latency of
  aristax (``generate``: one compiled decode step, fixed KV cache) and of HF eager
  (``MixtralForCausalLM``, attn_implementation="eager", a ``DynamicCache`` loop, which
  is ``generate`` without its logits processors);
* the roofline: bytes of the weights one decode token must read (attention, router,
  K experts, LM head, the KV cache) / the weight-streaming bandwidth of a float32
  4096x16384 matrix-vector product measured in each round, just before our decode
  (the fastest of JAX in both weight layouts, numpy and torch);
* paired windows: many short batch-1 decodes, each with the bandwidth measured just
  before and just after it, so that each ratio to the roofline compares measurements
  under a second apart (this machine's bandwidth drifts by a third within seconds);
* the GEMV floor: the same weights in the step's own shapes ([out, in] matrices of
  1-33 MB, one after another), timed as a chain of bare matrix-vector products in JAX
  and torch; it says how much of the gap to the roofline these shapes cost anyone;
* decode latency vs number of experts (top-2; models of ``--sweep-layers`` layers,
  measured round-robin): decode reads only the 2 selected experts, so it should stay
  flat;
* batch 8 decode and a 512-token prefill, aristax and HF.

With JAX on a GPU, HF and the torch forms run on CUDA (timed to the end of their
kernels), numpy is left out, and the results go to ``decode_vs_hf_gpu.json``.

    python experiments/benchmarks/decode_vs_hf.py            # full run (minutes)
    python experiments/benchmarks/decode_vs_hf.py --quick    # 2 layers, 16 tokens

XLA:CPU streams a matrix-vector product whose weight is held [in, out] with a long
contraction at about half of torch's rate, so ``generate`` decodes with [out, in]
copies (``Mixtral.decode_weights``; see ``aristax.models.sparse_moe``). ``--xla-flags``
(default: XNNPACK dots on the CPU; none where a JAX CUDA plugin is installed, whose XLA
may not know CPU flags and would stop at an unknown one) is exported before JAX starts
and applies to aristax and to the JAX roofline forms alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from aristax.argtypes import nonnegative_int, positive_int, positive_ints


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=positive_int, default=12)
    p.add_argument("--new-tokens", type=positive_int, default=128)
    p.add_argument("--prompt", type=positive_int, default=10)
    p.add_argument("--experts", type=positive_int, default=6)
    p.add_argument("--sweep-experts", default="2,4,6,8", help="'' to skip the sweep",
                   type=lambda text: positive_ints(text) if text else [])
    p.add_argument("--sweep-layers", type=positive_int, default=4,
                   help="layers of the sweep models (all are held in memory at once)")
    p.add_argument("--sweep-rounds", type=positive_int, default=4)
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds of (bandwidth, GEMV floor, aristax, HF) for the batch-1 decode")
    p.add_argument("--windows", type=nonnegative_int, default=24,
                   help="paired windows of (bandwidth, short decode, bandwidth); 0 to skip")
    p.add_argument("--window-tokens", type=positive_int, default=16)
    p.add_argument("--batch", type=nonnegative_int, default=8, help="batched decode (0 to skip)")
    p.add_argument("--prefill", type=nonnegative_int, default=512, help="prefill length (0 to skip)")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face")
    p.add_argument("--quick", action="store_true",
                   help="2 layers, 16 new tokens, sweep 2,8, batch 8, prefill 128")
    p.add_argument("--xla-flags", default=None, help="default: XNNPACK dots on the CPU")
    p.add_argument("--out", help="default: results/decode_vs_hf_<JAX backend>.json")
    args = p.parse_args(argv)
    if args.xla_flags is None:
        cuda = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
        args.xla_flags = "" if cuda else "--xla_cpu_use_xnnpack=true"
    if args.quick:
        args.layers, args.new_tokens, args.sweep_experts, args.rounds = 2, 16, [2, 8], 1
        args.windows = min(args.windows, 4)
        args.sweep_layers, args.sweep_rounds = 2, 2
        args.prefill = min(args.prefill, 128)
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.xla_flags:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + ARGS.xla_flags).strip()

import json  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from aristax.models import Mixtral, MixtralConfig  # noqa: E402
from aristax.models.generate import generate_with_stats  # noqa: E402


def torch_device() -> str | None:
    """Where torch (the peer, and the torch GEMV forms) runs beside JAX: "cpu" with JAX on
    the CPU, "cuda" with JAX on a GPU that torch sees too; None without torch or without
    that GPU, and then HF and the torch forms are left out."""
    try:
        import torch
    except ImportError:
        return None
    if jax.default_backend() == "cpu":
        return "cpu"
    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else None


TORCH_DEVICE = torch_device()


def torch_wait() -> None:
    """Wait for torch's queued GPU work, so that a timer read after it counts the work
    (CUDA calls return before their kernels finish)."""
    if TORCH_DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def tiny_mistral(layers: int, experts: int) -> MixtralConfig:
    return MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                         num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=experts,
                         num_experts_per_tok=2, max_position_embeddings=4096,
                         eos_token_id=None)


def weight_bytes_per_token(cfg: MixtralConfig, cache_len: int) -> int:
    """Bytes one decode token reads: attention, router, K experts, norms per layer,
    the KV cache, the final norm and the LM head (the embedding row is negligible)."""
    D, Dh, H, G = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, \
        cfg.num_key_value_heads
    item = jnp.dtype(cfg.dtype).itemsize
    attn = D * H * Dh * 2 + D * G * Dh * 2
    experts = cfg.num_experts_per_tok * 3 * D * cfg.intermediate_size
    per_layer = attn + D * cfg.num_local_experts + experts + 2 * D + 2 * cache_len * G * Dh
    return item * (cfg.num_hidden_layers * per_layer + D + D * cfg.vocab_size)


def _best_and_median(fn, reps: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), float(np.median(times))


def _time_forms(forms: dict, nbytes: int, reps: int) -> dict:
    """Each form (a callable that reads ``nbytes`` of weights) timed, best and median of
    ``reps``, and the fastest form."""
    res = {}
    for name, fn in forms.items():
        best, med = _best_and_median(fn, reps)
        res[name] = {"best_ms": 1e3 * best, "median_ms": 1e3 * med,
                     "gb_per_s_best": nbytes / best / 1e9, "gb_per_s_median": nbytes / med / 1e9}
    return {"forms": res, "fastest": min(res, key=lambda k: res[k]["best_ms"])}


def bandwidth_probe(rows=4096, cols=16384):
    """A function ``probe(reps) -> dict``: GB/s of a float32 matrix-vector product over
    a [rows, cols] weight (best of ``reps``), in every form at hand: jax.jit ``v @ w`` and
    ``w.T @ v`` (the weight stored transposed), numpy (with JAX on the CPU), and torch
    on ``TORCH_DEVICE``. The ceiling is the fastest form. The weights are made once,
    here."""
    w = np.random.default_rng(0).standard_normal((rows, cols), np.float32)
    v = np.random.default_rng(1).standard_normal(rows, np.float32)
    wj, wtj, vj = jnp.asarray(w), jnp.asarray(np.ascontiguousarray(w.T)), jnp.asarray(v)
    forms = {
        "jax v@w": lambda f=jax.jit(lambda w, v: v @ w): f(wj, vj).block_until_ready(),
        "jax wT@v": lambda f=jax.jit(lambda wt, v: wt @ v): f(wtj, vj).block_until_ready(),
    }
    if jax.default_backend() == "cpu":
        forms["numpy v@w"] = lambda: v @ w
    if TORCH_DEVICE:
        import torch

        tw, tv = (torch.from_numpy(a).to(TORCH_DEVICE) for a in (w, v))
        forms["torch v@w"] = lambda: (tv @ tw, torch_wait())

    def probe(reps: int) -> dict:
        res = {"shape": [rows, cols], **_time_forms(forms, w.nbytes, reps)}
        res["gb_per_s_best"] = res["forms"][res["fastest"]]["gb_per_s_best"]
        return res

    return probe


def active_gemvs(weights, top_k: int) -> list:
    """The [out, in] weights one decode token streams, in step order: per layer q|k|v,
    o and the gate|up and down of ``top_k`` experts (the first ones: any K read the
    same bytes), then the LM head."""
    mats = []
    for layer in weights.layers:
        gate_ups, downs = layer.experts
        mats += [layer.qkv_nd, layer.o_dn]
        for gate_up, down in zip(gate_ups[:top_k], downs[:top_k]):
            mats += [gate_up, down]
    return mats + [weights.head_vd]


def gemv_floor_probe(weights, top_k: int):
    """A function ``floor(reps) -> dict``: the same GEMV shapes as a decode step, and
    nothing else: a dependent chain over ``active_gemvs`` (each product's input is built
    from the last output, so nothing reorders or overlaps across layers; the K experts
    of a layer are independent, as in the step). Timed in JAX (one jitted call on the
    model's own decode weights) and in torch (zero-copy views of the same buffers); best
    of ``reps`` each. This is the bandwidth the model's shapes get here, where the
    roofline's one 268 MB product streams fastest."""
    mats = active_gemvs(weights, top_k)
    per_layer = 2 + 2 * top_k
    nbytes = sum(m.nbytes for m in mats)

    def chain(mm, v, nonlin):
        for i in range(0, len(mm) - 1, per_layer):
            qkv, o, *experts = mm[i:i + per_layer]
            v = v + o @ nonlin((qkv @ v)[:o.shape[1]])
            h = 0
            for gate_up, down in zip(experts[::2], experts[1::2]):
                gu = gate_up @ v
                h = h + down @ (nonlin(gu[:down.shape[1]]) * gu[down.shape[1]:])
            v = v + h
        return mm[-1] @ v

    jchain = jax.jit(lambda mm, v: chain(mm, v, jax.nn.silu))
    v = jnp.full((mats[0].shape[1],), 0.01, mats[0].dtype)
    forms = {"jax": lambda: jchain(mats, v).block_until_ready()}
    if TORCH_DEVICE:
        import torch

        # on the CPU zero-copy views (read only); on a GPU copies
        tm = [torch.from_numpy(np.asarray(m)).to(TORCH_DEVICE) for m in mats]
        tv = torch.from_numpy(np.asarray(v).copy()).to(TORCH_DEVICE)
        forms["torch"] = lambda: (chain(tm, tv, torch.nn.functional.silu), torch_wait())

    def floor(reps: int) -> dict:
        res = {"bytes": nbytes, **_time_forms(forms, nbytes, reps)}
        res["ms"] = res["forms"][res["fastest"]]["best_ms"]
        return res

    return floor


def build(cfg: MixtralConfig, seed: int = 0) -> Mixtral:
    t = time.perf_counter()
    model = Mixtral(cfg, rngs=nnx.Rngs(seed))
    jax.block_until_ready(nnx.state(model))
    log(f"  built {cfg.num_local_experts}-expert model in {time.perf_counter() - t:.1f}s")
    return model


def step_stats(step_s, batch: int) -> dict:
    """Per-step decode latency: mean, median and min (the min and median resist other
    processes' load; the mean is what a user waits)."""
    ms = 1e3 * np.asarray(step_s)
    return {"ms_per_token": float(ms.mean()), "ms_per_token_median": float(np.median(ms)),
            "ms_per_token_min": float(ms.min()), "tokens_per_s": 1e3 / float(ms.mean()) * batch,
            "steps": int(ms.size)}


def ours_decode(model, prompt, new_tokens, weights, repeats=2) -> dict:
    """Steady-state decode steps of ``repeats`` runs pooled (each run's first decode
    step, which compiles when cold, is excluded; the first run's prefill compiles, so
    the prefill reported is the best run's)."""
    runs = [generate_with_stats(model, prompt, new_tokens, decode_weights=weights)
            for _ in range(repeats)]
    steps = [t for _, st in runs for t in st.step_s]
    res = step_stats(steps, prompt.shape[0])
    res["prefill_ms"] = 1e3 * min(st.prefill_s for _, st in runs)
    res["tokens"] = runs[-1][0][:, prompt.shape[1]:]
    return res


def paired_windows(model, prompt, weights, cfg, probe, floor, windows: int, tokens: int,
                   reps: int = 5) -> dict:
    """Our batch-1 decode against a roofline measured around it, ``windows`` times: the
    GEMV bandwidth (``probe``, best of ``reps`` per form) just before and just after a
    ``tokens``-token decode, the window's roofline from the higher of the two (the
    stricter ceiling) and the bytes of a cache of prompt + ``tokens``; and the GEMV
    floor (``floor``, best of ``reps``) just before the decode. This machine's
    bandwidth swings by a third within seconds (other tenants), which a roofline taken
    a minute away from the decode mistakes for our speed; a window's measurements lie
    under a second apart. ``gemv_floor_over_roofline`` is the share of the gap that the
    model's shapes alone cost."""
    nbytes = weight_bytes_per_token(cfg, prompt.shape[1] + tokens)
    generate_with_stats(model, prompt, tokens, decode_weights=weights)  # compile
    rows = []
    for _ in range(windows):
        before = probe(reps)["gb_per_s_best"]
        floor_ms = floor(reps)["ms"]
        step_s = generate_with_stats(model, prompt, tokens, decode_weights=weights)[1].step_s
        gb_per_s = max(before, probe(reps)["gb_per_s_best"])
        roofline, ms = 1e3 * nbytes / (gb_per_s * 1e9), 1e3 * float(np.median(step_s))
        rows.append({"gb_per_s": gb_per_s, "roofline_ms": roofline, "ours_ms_median": ms,
                     "gemv_floor_ms": floor_ms, "ours_over_roofline": ms / roofline,
                     "gemv_floor_over_roofline": floor_ms / roofline,
                     "ours_over_gemv_floor": ms / floor_ms})
    res = {"tokens": tokens, "reps": reps, "bytes_per_token": nbytes}
    for key in ("ours_over_roofline", "gemv_floor_over_roofline", "ours_over_gemv_floor"):
        ratio = [r[key] for r in rows]
        res.update({f"{key}_{name}": float(np.percentile(ratio, q))
                    for name, q in (("p25", 25), ("median", 50), ("p75", 75))})
    return {**res, "windows": rows}


def hf_decode(hf, prompt, new_tokens) -> dict:
    """HF eager: prefill, then a DynamicCache loop of greedy single-token steps (each
    step timed to its token's arrival, as ours are)."""
    import torch

    ids = torch.as_tensor(prompt, device=TORCH_DEVICE)
    with torch.no_grad():
        hf(ids[:, :2], use_cache=True)  # warm-up
        torch_wait()
        t0 = time.perf_counter()
        out = hf(ids, use_cache=True)
        torch_wait()
        prefill = time.perf_counter() - t0
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
        tokens, times = [tok], []
        for _ in range(new_tokens - 1):
            t = time.perf_counter()
            out = hf(tok[:, None], past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
            torch_wait()
            times.append(time.perf_counter() - t)
            tokens.append(tok)
    res = step_stats(times[1:], prompt.shape[0])
    res.update(prefill_ms=1e3 * prefill, tokens=torch.stack(tokens, 1).cpu().numpy())
    return res


def prefill_ms(model, prompt, weights, hf=None, rounds: int = 3) -> dict:
    """Prefill of prompt [1, S]: ours (``generate``'s compiled prefill) and HF's forward
    with a cache, one warm-up each, then alternated ``rounds`` times so that this
    machine's drift hits both alike; ratios of the medians and of the minima."""
    def ours():
        return generate_with_stats(model, prompt, 1, decode_weights=weights)[1].prefill_s

    def theirs():
        import torch

        with torch.no_grad():
            ids = torch.as_tensor(prompt, device=TORCH_DEVICE)
            torch_wait()
            t = time.perf_counter()
            hf(ids, use_cache=True)
            torch_wait()
            return time.perf_counter() - t

    timed = {"ours": ours} | ({} if hf is None else {"hf": theirs})
    for fn in timed.values():
        fn()  # compile / warm up
    times = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            times[name].append(1e3 * fn())
    res = {"tokens": int(prompt.shape[1]), "rounds": rounds}
    for name, ms in times.items():
        res[f"{name}_ms"], res[f"{name}_ms_min"] = float(np.median(ms)), float(min(ms))
    if hf is not None:
        res["ours_over_hf"] = res["ours_ms"] / res["hf_ms"]
        res["ours_over_hf_min"] = res["ours_ms_min"] / res["hf_ms_min"]
    return res


def load_hf(model, machine: dict):
    """The model saved and reloaded as HF eager ``MixtralForCausalLM`` (float32) on
    ``TORCH_DEVICE``."""
    import torch
    import transformers

    machine.update(torch=torch.__version__, torch_device=TORCH_DEVICE,
                   torch_threads=torch.get_num_threads(),
                   transformers=transformers.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        log("saving for HF ...")
        model.save_pretrained(tmp)
        return transformers.MixtralForCausalLM.from_pretrained(
            tmp, attn_implementation="eager", dtype=torch.float32).eval().to(TORCH_DEVICE)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "device_kind": jax.devices()[0].device_kind,
            "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f
                               if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def ratios(name: str, res: dict, roofline: float) -> dict:
    return {f"{name}_over_roofline": res["ms_per_token"] / roofline,
            f"{name}_over_roofline_median": res["ms_per_token_median"] / roofline,
            f"{name}_over_roofline_min": res["ms_per_token_min"] / roofline}


def strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "tokens"}


def model_fields(cfg: MixtralConfig) -> dict:
    """The config fields the result records under "model"."""
    return {k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "num_local_experts",
        "num_experts_per_tok", "dtype")}


def load_peer(model, machine: dict, no_hf: bool):
    """The HF eager twin of ``model`` (``load_hf``), or None with ``--no-hf`` or without
    torch beside JAX (said on stderr)."""
    if TORCH_DEVICE is None and not no_hf:
        log(f"no torch on {jax.default_backend()}: Hugging Face left out")
    return None if no_hf or TORCH_DEVICE is None else load_hf(model, machine)


def decode_round(model, prompt, weights, hf, new_tokens: int, nbytes: int, probe,
                 floor) -> dict:
    """One round of (bandwidth, GEMV floor, aristax decode, HF decode) and the ratios of
    the decodes to this round's roofline, to the GEMV floor and to each other."""
    bw = probe(30)
    roofline = 1e3 * nbytes / (bw["gb_per_s_best"] * 1e9)
    fl = floor(10)
    ours = ours_decode(model, prompt, new_tokens, weights, repeats=1)
    rnd = {"bandwidth": bw, "roofline_ms": roofline, "ours": strip(ours),
           **ratios("ours", ours, roofline), "gemv_floor": fl,
           "gemv_floor_ms": fl["ms"],
           "ours_over_gemv_floor_median": ours["ms_per_token_median"] / fl["ms"]}
    if hf is not None:
        ref = hf_decode(hf, prompt, new_tokens)
        same = (ours["tokens"] == ref["tokens"])[0]
        rnd.update(hf=strip(ref), **ratios("hf", ref, roofline),
                   ours_over_hf=ours["ms_per_token"] / ref["ms_per_token"],
                   greedy_tokens_agree_prefix=int(np.argmin(same)) if not same.all()
                   else int(same.size), tokens_compared=int(same.size))
    return rnd


def batch1_rounds(model, prompt, weights, hf, new_tokens: int, nbytes: int, probe, floor,
                  rounds: int) -> dict:
    """The result's "roofline" and "decode_b1" entries: ``rounds`` rounds of
    ``decode_round`` (the other tenants' load on this machine drifts, so each round's
    ratios compare measurements seconds apart) and the median of each ratio over them."""
    rows = []
    for r in range(rounds):
        log(f"round {r + 1}/{rounds}: bandwidth, aristax decode, HF decode ...")
        rnd = decode_round(model, prompt, weights, hf, new_tokens, nbytes, probe, floor)
        log("  " + ", ".join(f"{k} {v:.3g}" for k, v in rnd.items()
                             if isinstance(v, float)))
        rows.append(rnd)
    summary = {k: float(np.median([rnd[k] for rnd in rows]))
               for k, v in rows[0].items() if isinstance(v, float)}
    res = {"roofline": {"bytes_per_token": nbytes,
                        "ms_per_token_median_of_rounds": summary.pop("roofline_ms")},
           "decode_b1": {"median_of_rounds": summary, "rounds": rows}}
    if hf is not None:
        res["decode_b1"]["greedy_tokens_agree_prefix_min"] = min(
            rnd["greedy_tokens_agree_prefix"] for rnd in rows)
    return res


def logged_windows(model, prompt, weights, cfg, probe, floor, windows: int,
                   tokens: int) -> dict:
    """``paired_windows``, with its progress and quartiles on stderr."""
    log(f"{windows} paired windows of bandwidth, {tokens}-token decode, bandwidth ...")
    paired = paired_windows(model, prompt, weights, cfg, probe, floor, windows, tokens)
    for key in ("ours_over_roofline", "gemv_floor_over_roofline", "ours_over_gemv_floor"):
        log(f"  {key}: p25 {paired[key + '_p25']:.3f} median "
            f"{paired[key + '_median']:.3f} p75 {paired[key + '_p75']:.3f}")
    return paired


def batch_decode(model, weights, hf, bprompt, new_tokens: int) -> dict:
    """Batched decode of ``bprompt`` [B, S] (at most 32 new tokens), aristax and HF."""
    log(f"batch {bprompt.shape[0]} decode ...")
    new = min(new_tokens, 32)
    bo = ours_decode(model, bprompt, new, weights)
    res = {"batch": bprompt.shape[0], "new_tokens": new, "ours": strip(bo)}
    if hf is not None:
        bh = hf_decode(hf, bprompt, new)
        res.update(hf=strip(bh), ours_over_hf=bo["ms_per_token"] / bh["ms_per_token"])
    log(f"  {res}")
    return res


def experts_sweep(sweep: list[int], prompt, layers: int, new_tokens: int,
                  rounds: int) -> dict:
    """Decode latency vs number of experts: all models at once (``layers`` layers to fit
    in memory), measured round-robin so that other processes' load hits every E alike."""
    models = {}
    for E in sweep:
        log(f"experts sweep: building E={E} ({layers} layers) ...")
        m = build(tiny_mistral(layers, E), seed=E)
        models[E] = (m, m.decode_weights())
        generate_with_stats(m, prompt, 2, decode_weights=models[E][1])  # compile
    steps = {E: [] for E in sweep}
    new = min(new_tokens, 32)
    for _ in range(rounds):
        for E, (m, w) in models.items():
            steps[E] += generate_with_stats(m, prompt, new, decode_weights=w)[1].step_s
    rows = [{"experts": E, **step_stats(steps[E], 1)} for E in sweep]
    flat = {}
    for key in ("ms_per_token", "ms_per_token_median", "ms_per_token_min"):
        ms = [r[key] for r in rows]
        flat[key] = max(ms) / min(ms)
    res = {"top_k": 2, "layers": layers, "rows": rows, "max_over_min": flat}
    log(f"  {res}")
    return res


def write_result(result: dict, out: str | None) -> None:
    """``result`` as JSON to ``out`` (default results/decode_vs_hf_<backend>.json beside
    this script), and all but its machine and args on stderr."""
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                              f"decode_vs_hf_{jax.default_backend()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=float)
    log(json.dumps({k: result[k] for k in result if k not in ("machine", "args")},
                   indent=1, default=float))


def main(args):
    result = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items()}}
    cfg = tiny_mistral(args.layers, args.experts)
    result["model"] = model_fields(cfg)
    model = build(cfg)
    weights = model.decode_weights()
    hf = load_peer(model, result["machine"], args.no_hf)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, size=(1, args.prompt)).astype(np.int32)
    nbytes = weight_bytes_per_token(cfg, args.prompt + args.new_tokens)
    # First compile both steps at this cache length; then rounds, and the paired windows
    # (measurements under a second apart).
    generate_with_stats(model, prompt, args.new_tokens, decode_weights=weights)
    probe = bandwidth_probe()
    floor = gemv_floor_probe(weights, cfg.num_experts_per_tok)
    result.update(batch1_rounds(model, prompt, weights, hf, args.new_tokens, nbytes, probe,
                                floor, args.rounds))
    if args.windows:
        result["decode_b1_paired"] = logged_windows(model, prompt, weights, cfg, probe, floor,
                                                    args.windows, args.window_tokens)
    if args.batch:
        bprompt = rng.integers(0, cfg.vocab_size, size=(args.batch, args.prompt)).astype(np.int32)
        result["decode_batch"] = batch_decode(model, weights, hf, bprompt, args.new_tokens)
    if args.prefill:
        log(f"prefill {args.prefill} ...")
        pprompt = rng.integers(0, cfg.vocab_size, size=(1, args.prefill)).astype(np.int32)
        result["prefill"] = prefill_ms(model, pprompt, weights, hf)
        log(f"  {result['prefill']}")
    del hf, model, weights
    sweep = args.sweep_experts
    if sweep:
        result["experts_sweep"] = experts_sweep(sweep, prompt, args.sweep_layers,
                                                args.new_tokens, args.sweep_rounds)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main(ARGS)
