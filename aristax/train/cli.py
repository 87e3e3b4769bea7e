"""``aristax train CONFIG [key=value ...]`` and ``aristax launch --local-processes N CONFIG``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from aristax.train import load_config, train
from aristax.train.launch import launch


def run_train(args: argparse.Namespace) -> int:
    """Handler of ``aristax train``. Errors propagate to ``aristax.cli.main``, which
    prints them as one line: ConfigError / FileNotFoundError (found before training
    starts) exit 2, FloatingPointError (the loss diverged) exits 1."""
    train(load_config(args.config, args.overrides))
    return 0


def run_launch(args: argparse.Namespace) -> int:
    """Handler of ``aristax launch``: ValueError for bad arguments (before any process
    starts), RuntimeError naming a process that failed. ``aristax --debug launch``
    passes the debug setting on to the train processes (ARISTAX_DEBUG=1)."""
    cfg = load_config(args.config, args.overrides)
    if getattr(args, "debug", False):
        os.environ["ARISTAX_DEBUG"] = "1"
    return launch(args.config, args.overrides, args.local_processes,
                  out_dir=Path(cfg.out_dir), devices=cfg.parallel.devices, grace=args.grace)


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
