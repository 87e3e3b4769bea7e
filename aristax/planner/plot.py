"""Pictures of a Plan (``aristax plan --png``), drawn with matplotlib's Agg backend.

matplotlib is the optional extra ``plot`` (``pip install 'aristax[plot]'``); it is
imported only when a figure is drawn. The pure helpers (:func:`group_order`,
:func:`message_bytes`, :func:`gantt_bars`) need only NumPy and are tested alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aristax.planner.spec import ModelSpec, Plan
from aristax.planner.topology import Topology

INSTALL_HINT = "pip install 'aristax[plot]'"


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or an ImportError naming the extra."""
    try:
        import matplotlib
    except ImportError as e:  # also when sys.modules["matplotlib"] is None
        raise ImportError(f"--png needs matplotlib, which is not installed; run: {INSTALL_HINT}") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------- pure helpers
def group_order(plan: Plan) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(order[V], spans[G]): global device ids with each group contiguous (groups in
    plan order), and each group's half-open [start, stop) in that order."""
    order, spans, start = [], [], 0
    for g in plan.groups:
        order.extend(g)
        spans.append((start, start + len(g)))
        start += len(g)
    return np.asarray(order, dtype=np.int64), spans


def message_bytes(plan: Plan, model: ModelSpec) -> float:
    """Bytes of one dispatch message under uniform routing: T K D bytes_per_element
    spread over the largest group, T K D b / max |g| (the heatmap's message size)."""
    per_device = model.tokens_per_device * model.top_k * model.d_model * model.bytes_per_element
    return float(per_device) / max(len(g) for g in plan.groups)


def gantt_bars(plan: Plan, g: int) -> list[tuple[int, float, float, int, int]]:
    """Bars of group g's dispatch schedule: (sender_local, start_s, length_s,
    receiver_global, round). Rounds run back to back (Aurora Thm 4.2's order); a
    send starts with its round and lasts its amount (seconds of link time)."""
    group = plan.groups[g]
    bars, t = [], 0.0
    for r, rnd in enumerate(plan.schedules[g].rounds):
        for i, j, amount in rnd.sends:
            if amount > 0:
                bars.append((int(i), t, float(amount), int(group[j]), r))
        t += rnd.duration
    return bars


def slowest_group(plan: Plan) -> int:
    """Index of the group whose dispatch schedule has the largest makespan."""
    return int(np.argmax([s.makespan for s in plan.schedules]))


# ---------------------------------------------------------------------- panels
def _heatmap(ax, fig, plan: Plan, topology: Topology, model: ModelSpec, rectangle) -> None:
    """``rectangle``: matplotlib's Rectangle patch class (``plt.Rectangle``)."""
    order, spans = group_order(plan)
    nbytes = message_bytes(plan, model)
    t = topology.p2p_time(nbytes)[np.ix_(order, order)] * 1e6
    im = ax.imshow(t, cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="alpha + beta * bytes (us)")
    for k, (a, b) in enumerate(spans):
        ax.add_patch(rectangle((a - 0.5, a - 0.5), b - a, b - a, fill=False, edgecolor="red", linewidth=2))
        ax.text(a - 0.4, a - 0.2, f"g{k}", color="red", fontsize=9, va="top", fontweight="bold")
    step = max(1, len(order) // 16)
    ticks = np.arange(0, len(order), step)
    ax.set_xticks(ticks, [str(order[i]) for i in ticks])
    ax.set_yticks(ticks, [str(order[i]) for i in ticks])
    ax.set_xlabel("receiver device")
    ax.set_ylabel("sender device")
    ax.set_title(f"{topology.name}: p2p time of a {nbytes / 1e6:.2f} MB message\n(groups outlined)")


def _experts(ax, plan: Plan, topology: Topology, colors) -> None:
    order, spans = group_order(plan)
    counts, labels, bar_colors = [], [], []
    for k, (group, reps) in enumerate(zip(plan.groups, plan.replicas)):
        for d, xs in zip(group, reps):
            counts.append(len(xs))
            node = int(topology.node[d]) if topology.node is not None else 0
            labels.append(f"{d}\nn{node}")
            bar_colors.append(colors(k % 10))
    x = np.arange(len(order))
    ax.bar(x, counts, color=bar_colors, edgecolor="black", linewidth=0.5)
    step = max(1, len(order) // 16)
    ax.set_xticks(x[::step], labels[::step], fontsize=8)
    for k, (a, _) in enumerate(spans):
        ax.bar([a], [0], color=colors(k % 10), label=f"group {k}")  # legend entry
    ax.set_ylim(0, max(counts) * 1.25)  # headroom for the legend
    if len(spans) <= 10:
        ax.legend(fontsize=8, loc="upper right", ncol=min(len(spans), 5))
    if len(order) <= 16:
        for xi, group_reps in zip(x, [r for reps in plan.replicas for r in reps]):
            shown = ",".join(map(str, group_reps[:6])) + ("…" if len(group_reps) > 6 else "")
            ax.text(xi, 0.1, shown, rotation=90, ha="center", va="bottom", fontsize=7, color="white")
    ax.set_xlabel("device (n = host)")
    ax.set_ylabel("experts (slots)")
    ax.set_title(f"experts per device ({plan.num_experts} experts, {len(plan.groups)} groups)")


def _gantt(ax, plan: Plan, g: int, colors) -> None:
    group = plan.groups[g]
    bars = gantt_bars(plan, g)
    for sender, start, length, receiver, r in bars:
        ax.barh(sender, length * 1e6, left=start * 1e6, height=0.7, color=colors(r % 9),
                edgecolor="black", linewidth=0.5)
        ax.text((start + length / 2) * 1e6, sender, f"→{receiver}", ha="center", va="center", fontsize=9)
    t = 0.0
    for rnd in plan.schedules[g].rounds:
        ax.axvline(t * 1e6, color="gray", linestyle=":", linewidth=0.8)
        t += rnd.duration
    ax.axvline(t * 1e6, color="gray", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(group)), [str(d) for d in group])
    ax.invert_yaxis()
    ax.set_xlabel("time (us); colour and dotted lines: rounds")
    ax.set_ylabel("sender device")
    ax.set_title(f"group {g} dispatch all-to-all: {plan.schedules[g].num_rounds} rounds, "
                 f"{plan.schedules[g].makespan * 1e6:.1f} us\n(bar label: receiver device)")


def plot_plan(plan: Plan, topology: Topology, model: ModelSpec, path: str | Path,
              group: int | None = None) -> Path:
    """Write a PNG with three panels: topology heatmap with groups outlined (devices
    reordered so groups are contiguous), experts per device, and the all-to-all
    schedule of ``group`` (default: :func:`slowest_group`) as a Gantt chart.

    Raises ImportError naming ``pip install 'aristax[plot]'`` without matplotlib, and
    ValueError for a group index outside the plan or a path not ending in .png.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--png path {str(path)!r} must end in .png.")
    g = slowest_group(plan) if group is None else group
    if not 0 <= g < len(plan.groups):
        raise ValueError(f"group={g} is outside the plan's {len(plan.groups)} groups.")
    plt = _pyplot()
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 3, figsize=(20, 6.5), gridspec_kw={"width_ratios": [1.1, 1, 1.3]})
    try:
        _heatmap(axes[0], fig, plan, topology, model, plt.Rectangle)
        _experts(axes[1], plan, topology, colors)
        _gantt(axes[2], plan, g, plt.get_cmap("Pastel1"))  # round colours, unlike group colours
        fig.suptitle(f"aristax plan: {topology.name}, {plan.num_devices} devices, "
                     f"{plan.num_experts} experts (grouping: {plan.meta.get('grouping', '?')})")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
