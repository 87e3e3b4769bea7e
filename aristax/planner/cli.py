"""`aristax plan`: print (and optionally save) a Plan for a topology.

    aristax plan TOPOLOGY [--experts N] [--top-k K] [--d-model D] [--d-ff F]
                 [--tokens T] [--json OUT.json] [--png OUT.png]

The plan prints as rich tables (devices; rounds per group; partitions; simulated
time); ``--png`` draws it with matplotlib (the ``plot`` extra).

TOPOLOGY is a YAML/JSON file (``Topology.load``) or a preset spec ``name[:arg,...]``,
e.g. ``perlmutter:4`` (4 nodes), ``dgx_h100:2``, ``heterogeneous_mix:1,2``. The lead's
``aristax/cli.py`` calls :func:`register` and then ``args.func(args)``.
"""

from __future__ import annotations

import argparse
import difflib
import io
import re
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from aristax.argtypes import positive_int
from aristax.planner.plan import make_plan
from aristax.planner.plot import plot_plan
from aristax.planner.simulate import simulate
from aristax.planner.spec import ModelSpec, Plan
from aristax.planner.topology import PRESETS, Topology, preset


def parse_topology(spec: str) -> Topology:
    """A file path (.yaml/.yml/.json) or ``preset[:args]``, args comma-separated
    numbers, positional then key=value (``uniform:8,expert_capacity=2``)."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.exists():
            raise ValueError(f"topology file {spec!r} does not exist; give a path or a preset like perlmutter:4.")
        return Topology.load(path)
    name, _, args = spec.partition(":")
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"TOPOLOGY {spec!r} is neither a .yaml/.json file nor a preset; "
                         f"{hint}use one of {sorted(PRESETS)}, e.g. perlmutter:4.")
    values, keywords = [], {}
    for item in args.split(",") if args else []:
        key, eq, text = item.rpartition("=")
        try:
            value = int(text) if text.strip().lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise ValueError(f"preset arguments in {spec!r} must be numbers, positional or "
                             "key=value, e.g. heterogeneous_mix:1,2 or "
                             "uniform:8,expert_capacity=2.") from None
        if eq:
            keywords[key.strip()] = value
        elif keywords:
            raise ValueError(f"preset arguments in {spec!r}: positional ones come before "
                             "key=value ones, e.g. uniform:8,expert_capacity=2.")
        else:
            values.append(value)
    try:
        return preset(name, *values, **keywords)
    except ValueError as err:
        raise ValueError(f"TOPOLOGY {spec!r}: {err}") from None


def _experts_text(xs) -> str:
    return ",".join(map(str, xs)) if len(xs) <= 16 else ",".join(map(str, xs[:16])) + ",..."


def plan_tables(plan: Plan, topology: Topology, iteration: float | None = None) -> list:
    """rich renderables: a header line, the device table (device, group, node,
    #exp, experts), the group table (size, rounds, dispatch us), partitions and the
    simulated iteration time. Tables use ``box.SIMPLE`` (no vertical rules), so each
    row stays one whitespace-separated line in logs."""
    out: list = [Text(f"plan for {topology.name}: {plan.num_devices} devices, {plan.num_experts} experts, "
                      f"{len(plan.groups)} groups (grouping: {plan.meta.get('grouping', '?')})", style="bold")]
    dev = Table(title="devices", box=box.SIMPLE, title_justify="left")
    for col in ("device", "group", "node", "#exp"):
        dev.add_column(col, justify="right")
    dev.add_column("experts", overflow="fold")
    for g, group in enumerate(plan.groups):
        for d, xs in zip(group, plan.replicas[g]):
            node = int(topology.node[d]) if topology.node is not None else 0
            dev.add_row(str(d), str(g), str(node), str(len(xs)), _experts_text(xs))
        if g + 1 < len(plan.groups):
            dev.add_section()
    grp = Table(title="all-to-all per group (Aurora Thm 4.2)", box=box.SIMPLE, title_justify="left")
    for col in ("group", "size", "rounds", "dispatch_us", "lower_bound_us"):
        grp.add_column(col, justify="right")
    for g, group in enumerate(plan.groups):
        s = plan.schedules[g]
        grp.add_row(str(g), str(len(group)), str(s.num_rounds), f"{s.makespan * 1e6:.1f}",
                    f"{s.lower_bound * 1e6:.1f}")
    out += [dev, grp, Text("partitions (Lancet 5.1): " + ", ".join(
        f"{n}={k}" for n, k in zip(plan.op_names, plan.partition_counts)))]
    if iteration is not None:
        out.append(Text(f"simulated iteration time: {iteration * 1e3:.3f} ms", style="bold"))
    return out


def format_plan(plan: Plan, topology: Topology, iteration: float | None = None, *, width: int = 120) -> str:
    """:func:`plan_tables` rendered to plain text (no colour) at ``width`` columns."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    for r in plan_tables(plan, topology, iteration):
        console.print(r)
    return console.file.getvalue()


# ModelSpec's fields by the flag that sets them
SPEC_FLAGS = {"num_experts": "--experts", "top_k": "--top-k", "d_model": "--d-model",
              "d_ff": "--d-ff", "tokens_per_device": "--tokens"}


def run(args: argparse.Namespace) -> int:
    """Build the plan, print the tables, write JSON / PNG if asked; returns 0. Bad
    arguments and infeasible plans raise ValueError (``aristax.cli.main`` prints it as
    one line and exits with 2)."""
    if args.png and not args.png.lower().endswith(".png"):
        raise ValueError(f"--png {args.png!r} must end in .png, e.g. --png plan.png.")
    for flag, out in (("--json", args.json), ("--png", args.png)):
        if out and (Path(out).is_dir() or not Path(out).absolute().parent.is_dir()):
            raise ValueError(f"{flag} {out!r}: "
                             + ("is a directory; name a file in it" if Path(out).is_dir() else
                                "its directory does not exist; create it first"))
    topology = parse_topology(args.topology)
    try:
        model = ModelSpec(num_experts=args.experts, top_k=args.top_k, d_model=args.d_model,
                          d_ff=args.d_ff, tokens_per_device=args.tokens)
        plan = make_plan(topology, model, equal_groups=args.equal_groups)
    except ValueError as err:  # they name ModelSpec's fields; the user typed the flags
        raise ValueError(re.sub(r"\b(?:\w+\.)?(\w+)\b",
                                lambda m: SPEC_FLAGS.get(m[1], m[0]), str(err))) from None
    console = Console()
    for r in plan_tables(plan, topology, simulate(plan, topology, model).iteration):
        console.print(r)
    if args.json:
        Path(args.json).write_text(plan.to_json(indent=1))
        console.print(f"wrote {args.json}")
    if args.png:
        plot_plan(plan, topology, model, args.png)
        console.print(f"wrote {args.png}")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse subparsers object (func=run)."""
    p = subparsers.add_parser("plan", help="plan expert parallelism for a cluster topology",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("topology", metavar="TOPOLOGY",
                   help="topology .yaml/.json or preset[:args], e.g. perlmutter:4 or "
                        "uniform:8,expert_capacity=2 (positional, then key=value)")
    p.add_argument("--experts", type=positive_int, default=64, help="number of experts E (default 64)")
    p.add_argument("--top-k", type=positive_int, default=2, help="experts per token K (default 2)")
    p.add_argument("--d-model", type=positive_int, default=1024, help="model dim D (default 1024)")
    p.add_argument("--d-ff", type=positive_int, default=4096, help="expert hidden dim F (default 4096)")
    p.add_argument("--tokens", type=positive_int, default=4096, help="tokens per device per micro-batch T (default 4096)")
    p.add_argument("--equal-groups", action="store_true",
                   help="only groups of one size, as a device mesh (mesh_from_plan) and "
                        "aristax train need")
    p.add_argument("--json", metavar="OUT.json", default=None, help="also write the plan as JSON")
    p.add_argument("--png", metavar="OUT.png", default=None,
                   help="also draw topology heatmap, experts per device and the slowest group's "
                        "all-to-all schedule (needs pip install 'aristax[plot]')")
    p.set_defaults(func=run)
    return p
