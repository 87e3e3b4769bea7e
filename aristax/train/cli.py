"""``aristax train CONFIG [key=value ...]`` and ``aristax launch --local-processes N CONFIG``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aristax.train import ConfigError, load_config, train
from aristax.train.launch import launch


def _config(args: argparse.Namespace):
    """The config of ``args``, or None after printing why it is invalid."""
    try:
        return load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        print(f"aristax {args.command}: {err}", file=sys.stderr)
        return None


def run_train(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if cfg is None:
        return 2
    try:
        train(cfg)
    except (ConfigError, FileNotFoundError) as err:  # found before training starts
        print(f"aristax train: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # the loss diverged
        print(f"aristax train: {err}", file=sys.stderr)
        return 1
    return 0


def run_launch(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if cfg is None:
        return 2
    try:
        return launch(args.config, args.overrides, args.local_processes,
                      out_dir=Path(cfg.out_dir), devices=cfg.parallel.devices, grace=args.grace)
    except ValueError as err:  # bad arguments, found before any process starts
        print(f"aristax launch: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"aristax launch: {err}", file=sys.stderr)
        return 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train an MoE LM from a config (experiments/configs/*.yaml)",
        description="Train from CONFIG, a YAML file stating its differences from "
        "aristax.train.config.TrainConfig; key=value arguments override it (e.g. steps=50 "
        "optim.lr=1e-3 checkpoint.resume=true). On a cluster run it on every host: SLURM "
        "and ARISTAX_*/JAX_* variables are detected.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=run_train)
    q = subparsers.add_parser(
        "launch", help="run `aristax train` in N local processes (multi-host on one machine)")
    q.add_argument("--local-processes", type=int, required=True)
    q.add_argument("--grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when a peer fails")
    q.add_argument("config")
    q.add_argument("overrides", nargs="*", metavar="key=value")
    q.set_defaults(func=run_launch)
