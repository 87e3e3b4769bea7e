"""Aristos Fig. 3 scenario in simulation: GPT-3 350M MoE on 4x4 A100 80 GB (Perlmutter).

Simulated iteration time (aristax.planner.simulate: MoE layers' expert compute,
dispatch + combine all-to-alls in Aurora order, expert all-reduce; dense layers are
not modelled) of LysiGroup versus the expert-parallel grouping heuristics of Aristos
section 3: single-node groups (Narayanan et al.), world-size groups (Fedus et al.,
Rajbhandari et al.) and min |CG| (the smallest group that holds all experts), for
16-128 experts. GPT-3 350M: D = 1024, F = 4 D = 4096, 24 layers, MoE every 2nd layer
(Megatron-DeepSpeed GPT-3 MoE), top-1 routing, micro-batch 4 x 2048 tokens, 32 experts
per A100 80 GB (Aristos 3.2's memory assessment). Uniform routing.

What the seed reports (aristos-paper.md; Fig. 3 itself is an image, only these
numbers are in the text): "At 128 experts, Aristos yields a best case iteration
latency improvement of 1.498X and throughput increase of 1.493X over the naive
single-node communication grouping heuristic" (3.3); "naively minimizing all-to-all
communication group sizes leads to consistently suboptimal performance with the worst
at 1.49X degradation of training throughput and latency" (1.2); "for |X| >= 64,
executing the model becomes compute-bound hence the huge spike in latency for the
min |CG| heuristic" (3.3).

Usage: aristax bench planner_aristos [--out PATH]
Writes experiments/benchmarks/results/planner_aristos.json (default of --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from aristax.planner.plan import ModelSpec, baseline_groups, make_plan
from aristax.planner.simulate import simulate
from aristax.planner.topology import perlmutter

PAPER = {
    "speedup_vs_single_node_at_128_latency": 1.498,
    "speedup_vs_single_node_at_128_throughput": 1.493,
    "worst_degradation_of_min_cg": 1.49,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_aristos.json"),
                    help="where to write the JSON results (default: %(default)s)")
    args = ap.parse_args()
    top = perlmutter(4, expert_capacity=32)
    rows = []
    for experts in (16, 32, 64, 128):
        model = ModelSpec(num_experts=experts, top_k=1, d_model=1024, d_ff=4096, tokens_per_device=4 * 2048,
                          num_layers=24, moe_every=2)
        t0 = time.perf_counter()
        lysi = make_plan(top, model, select="lysi")
        plan_s = time.perf_counter() - t0
        row = {"experts": experts, "plan_s": plan_s,
               "lysi_groups": [len(g) for g in lysi.groups],
               "lysi_ms": simulate(lysi, top, model).iteration * 1e3}
        for kind in ("single_node", "world", "minimal"):
            groups = baseline_groups(top, experts, kind)
            row[f"{kind}_groups"] = [len(g) for g in groups]
            row[f"{kind}_ms"] = simulate(make_plan(top, model, groups=groups), top, model).iteration * 1e3
        row["speedup_vs_single_node"] = row["single_node_ms"] / row["lysi_ms"]
        row["speedup_vs_minimal"] = row["minimal_ms"] / row["lysi_ms"]
        rows.append(row)
    print(f"{'E':>4} {'lysi groups':>12} {'LysiGroup':>10} {'1 node':>9} {'world':>9} {'min|CG|':>9}"
          f" {'x vs node':>9} {'x vs min':>9}   (simulated ms/iteration)")
    for r in rows:
        print(f"{r['experts']:>4} {str(r['lysi_groups'][:1]) + 'x' + str(len(r['lysi_groups'])):>12}"
              f" {r['lysi_ms']:>10.2f} {r['single_node_ms']:>9.2f} {r['world_ms']:>9.2f} {r['minimal_ms']:>9.2f}"
              f" {r['speedup_vs_single_node']:>9.3f} {r['speedup_vs_minimal']:>9.3f}")
    print(f"paper (text of aristos-paper.md): {PAPER}")
    meta = {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "topology": top.name, "note": "simulated times (host model), not measured"}
    out = Path(args.out)
    out.write_text(json.dumps({"meta": meta, "paper": PAPER, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
