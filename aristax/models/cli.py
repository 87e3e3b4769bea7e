"""``aristax generate``: greedy or sampled generation from a local HF Mixtral or
Qwen3-MoE directory (the model is picked by config.json's ``model_type``).

    aristax generate CHECKPOINT --ids 1 415 2936 --max-new-tokens 32
    aristax generate CHECKPOINT --text "The capital of France is"   # needs tokenizer.json

Prints the generated token ids (and text when a tokenizer is available) and the
prefill time and decode tokens/s. ``aristax.cli`` calls ``register(subparsers)`` and
prints this handler's errors as one line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from aristax.config import check_float_dtype
from aristax.models import from_pretrained
from aristax.models.generate import generate_with_stats


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "generate",
        help="generate tokens from a local Hugging Face Mixtral or Qwen3-MoE checkpoint",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="directory with config.json and *.safetensors")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", type=int, nargs="+", help="prompt token ids")
    src.add_argument("--text", help="prompt text (needs tokenizer.json in the checkpoint)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the checkpoint's generation_config.json: "
                   "its temperature if it samples, else greedy)")
    p.add_argument("--top-k", type=int, default=None,
                   help="when sampling, keep the k most likely tokens; 0 = off (default: "
                   "generation_config.json's, else 50 as Hugging Face)")
    p.add_argument("--top-p", type=float, default=None,
                   help="when sampling, the nucleus threshold (default: "
                   "generation_config.json's, else 1.0)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    p.add_argument("--eos-token-id", type=int, default=None,
                   help="stop at this id (default: generation_config.json's EOS ids, else "
                   "config.json's; -1: never)")
    p.add_argument("--dtype", default=None, help="parameter dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
    return p


def _tokenizer(checkpoint: Path):
    path = checkpoint / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"--text needs {path}; pass token ids with --ids instead")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _check_flags(args: argparse.Namespace) -> None:
    """The flags' ranges, before the checkpoint is read."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.temperature is not None and not args.temperature >= 0:  # NaN too
        raise ValueError(f"--temperature={args.temperature} must be >= 0 (0 = greedy)")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k={args.top_k} must be >= 0 (0 = off)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p={args.top_p} must be in (0, 1]")
    check_float_dtype("--dtype", args.dtype, owner="")
    if not (Path(args.checkpoint) / "config.json").exists():
        raise FileNotFoundError(f"{args.checkpoint} has no config.json: not a Hugging Face "
                                "checkpoint directory")


def run(args: argparse.Namespace) -> int:
    """Handler of ``aristax generate``; returns 0. Bad flags and an unreadable
    checkpoint raise ValueError (CheckpointError) or FileNotFoundError, which
    ``aristax.cli.main`` prints as one line (exit status 2)."""
    _check_flags(args)
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    checkpoint = Path(args.checkpoint)
    tokenizer = _tokenizer(checkpoint) if args.text is not None else None
    prompt = tokenizer.encode(args.text).ids if tokenizer is not None else args.ids
    if not prompt:
        raise ValueError("the prompt is empty: give --ids or a --text that tokenizes")
    model = from_pretrained(checkpoint, dtype=args.dtype)
    eos = () if args.eos_token_id == -1 else args.eos_token_id  # None: the checkpoint's
    ids, stats = generate_with_stats(
        model, np.asarray([prompt]), args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
        rng=jax.random.key(args.seed))
    new = ids[0, len(prompt):].tolist()
    result = {
        "prompt_ids": list(prompt),
        "new_ids": new,
        "prefill_s": round(stats.prefill_s, 4),
        "first_step_s": round(stats.first_step_s, 4),
        "decode_tokens_per_s": round(stats.decode_steps / stats.decode_s, 2)
        if stats.decode_steps and stats.decode_s > 0 else None,
        "decode_ms_per_token": round(stats.decode_ms_per_token, 3)
        if stats.decode_steps and stats.decode_s > 0 else None,
    }
    if tokenizer is None and (checkpoint / "tokenizer.json").exists():
        tokenizer = _tokenizer(checkpoint)
    if tokenizer is not None:
        result["text"] = tokenizer.decode(new)
    if args.json:
        print(json.dumps(result))
    else:
        print("new tokens:", " ".join(map(str, new)))
        if "text" in result:
            print("text:", result["text"])
        rate = result["decode_tokens_per_s"]
        then = (f"then {rate} tokens/s ({result['decode_ms_per_token']} ms/token)"
                if rate is not None else "no later decode step to time")
        print(f"prefill (incl. compile): {result['prefill_s']} s; first decode step "
              f"(incl. compile): {result['first_step_s']} s; {then}")
    return 0
