"""LysiGroup wall time versus cluster size (Perlmutter preset), written to JSON.

Usage: aristax bench planner_lysi_scaling [--repeats 3]
Writes experiments/benchmarks/results/planner_lysi_scaling.json. The target is
1024 devices in under 2 s on a 2-core machine (issue 4).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from aristax.argtypes import positive_int
from aristax.planner.lysi import POLICIES, Workload, lysi_group, partition_cost
from aristax.planner.topology import perlmutter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_lysi_scaling.json"))
    args = ap.parse_args()
    rows = []
    for nodes in (4, 16, 64, 128, 256):
        for experts in (32, 64, 256):
            for policy in POLICIES:
                top, wl = perlmutter(nodes), Workload(num_experts=experts)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    groups = lysi_group(top, wl, policy=policy)
                    times.append(time.perf_counter() - t0)
                row = dict(devices=top.num_devices, experts=experts, policy=policy,
                           best_s=min(times), median_s=sorted(times)[len(times) // 2],
                           num_groups=len(groups), group_sizes=sorted({len(g) for g in groups}),
                           max_group_cost_s=partition_cost(groups, top, wl))
                rows.append(row)
                print(json.dumps(row))
    meta = dict(machine=platform.machine(), python=platform.python_version(), cpus=os.cpu_count(),
                note="shared 2-core machine; times are wall clock, best of --repeats")
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
