"""`aristax plan`: print (and optionally save) a Plan for a topology.

    aristax plan TOPOLOGY [--experts N] [--top-k K] [--d-model D] [--d-ff F]
                 [--tokens T] [--json OUT.json]

TOPOLOGY is a YAML/JSON file (``Topology.load``) or a preset spec ``name[:arg,...]``,
e.g. ``perlmutter:4`` (4 nodes), ``dgx_h100:2``, ``heterogeneous_mix:1,2``. The lead's
``aristax/cli.py`` calls :func:`register` and then ``args.func(args)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aristax.planner.plan import ModelSpec, Plan, make_plan
from aristax.planner.simulate import simulate
from aristax.planner.topology import PRESETS, Topology


def parse_topology(spec: str) -> Topology:
    """A file path (.yaml/.yml/.json) or ``preset[:int,int...]``."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.exists():
            raise ValueError(f"topology file {spec!r} does not exist; give a path or a preset like perlmutter:4.")
        return Topology.load(path)
    name, _, args = spec.partition(":")
    if name not in PRESETS:
        raise ValueError(f"TOPOLOGY {spec!r} is neither a .yaml/.json file nor a preset; "
                         f"use one of {sorted(PRESETS)}, e.g. perlmutter:4.")
    try:
        values = [int(a) for a in args.split(",")] if args else []
    except ValueError:
        raise ValueError(f"preset arguments in {spec!r} must be integers, e.g. heterogeneous_mix:1,2.") from None
    return PRESETS[name](*values)


def format_plan(plan: Plan, topology: Topology, iteration: float | None = None) -> str:
    """Plain-text table: one row per device (group, host, experts), then rounds."""
    lines = [f"plan for {topology.name}: {plan.num_devices} devices, {plan.num_experts} experts, "
             f"{len(plan.groups)} groups (grouping: {plan.meta.get('grouping', '?')})"]
    lines.append(f"{'group':>5} {'device':>6} {'node':>4} {'#exp':>4}  experts")
    for g, group in enumerate(plan.groups):
        for d, xs in zip(group, plan.replicas[g]):
            node = int(topology.node[d]) if topology.node is not None else 0
            shown = ",".join(map(str, xs)) if len(xs) <= 16 else ",".join(map(str, xs[:16])) + ",..."
            lines.append(f"{g:>5} {d:>6} {node:>4} {len(xs):>4}  {shown}")
    lines.append("")
    lines.append(f"{'group':>5} {'size':>4} {'rounds':>6} {'dispatch_us':>11}")
    for g, group in enumerate(plan.groups):
        s = plan.schedules[g]
        lines.append(f"{g:>5} {len(group):>4} {s.num_rounds:>6} {s.makespan * 1e6:>11.1f}")
    lines.append("")
    lines.append("partitions (Lancet 5.1): " + ", ".join(
        f"{n}={k}" for n, k in zip(plan.op_names, plan.partition_counts)))
    if iteration is not None:
        lines.append(f"simulated iteration time: {iteration * 1e3:.3f} ms")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Build the plan, print the table, write JSON if asked. Returns 0."""
    topology = parse_topology(args.topology)
    model = ModelSpec(num_experts=args.experts, top_k=args.top_k, d_model=args.d_model, d_ff=args.d_ff,
                      tokens_per_device=args.tokens)
    plan = make_plan(topology, model)
    print(format_plan(plan, topology, simulate(plan, topology, model).iteration))
    if args.json:
        Path(args.json).write_text(plan.to_json(indent=1))
        print(f"wrote {args.json}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse subparsers object (func=run)."""
    p = subparsers.add_parser("plan", help="plan expert parallelism for a cluster topology",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("topology", metavar="TOPOLOGY", help="topology .yaml/.json or preset, e.g. perlmutter:4")
    p.add_argument("--experts", type=int, default=64, help="number of experts E (default 64)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token K (default 2)")
    p.add_argument("--d-model", type=int, default=1024, help="model dim D (default 1024)")
    p.add_argument("--d-ff", type=int, default=4096, help="expert hidden dim F (default 4096)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per device per micro-batch T (default 4096)")
    p.add_argument("--json", metavar="OUT.json", default=None, help="also write the plan as JSON")
    p.set_defaults(func=run)
    return p
