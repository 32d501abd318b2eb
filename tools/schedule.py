"""Draw and measure a pipeline schedule: ``python -m tools.schedule --schedule dualpipe --pp 8
--microbatches 20 --out dualpipe.png``.

Generates the schedule (``parallel.pipeline.schedules``), simulates it with the given per-chunk costs
(``parallel.pipeline.simulator``; the defaults F=2, b=2, W=1, F&B=F+B, no p2p latency are the cost
model under which the report's bubble formulas are exact) and prints per-rank busy time, bubble and
peak live activations next to the table's formula. With ``--out`` it draws the timeline like the
report's figure: one row per rank, one box per compute action coloured by kind and chunk, the
micro-batch inside; an overlapped F&B is its forward and backward halves inside one black border; a
full backward (BW) is its B and W parts side by side.
"""
from __future__ import annotations

import argparse
import sys

from parallel.pipeline.schedules import SCHEDULES, Kind, Schedule, get_schedule
from parallel.pipeline.simulator import Costs, Simulation, simulate, table_bubble

# (chunk 0, chunk 1) colours per kind; chunk 1 is DualPipe's reverse direction / the V's way back.
COLOURS = {Kind.F: ("#fbd38d", "#e8912d"), Kind.B: ("#b5e3b5", "#4fae5b"), Kind.W: ("#b9d7f0", "#4a8fcf")}


def report(schedule: Schedule, costs: Costs, sim: Simulation) -> str:
    name, pp = schedule.name, schedule.pp
    lines = [f"{name}: pp={pp} micro-batches={schedule.n_microbatches} costs F={costs.f:g} b={costs.b:g} W={costs.w:g} "
             f"F&B={costs.of_fb():g} p2p={costs.p2p:g}  makespan={sim.makespan:g}",
             f"{'rank':>4} {'busy':>8} {'bubble':>8} {'peak act':>8}"]
    for r in range(pp):
        lines.append(f"{r:>4} {sim.busy[r]:>8g} {sim.bubble[r]:>8g} {sim.peak_activations[r]:>8d}")
    lines.append(f"bubble (max over ranks) {sim.max_bubble:g}; table formula {table_bubble(name, pp, costs):g}; "
                 f"peak activations {max(sim.peak_activations)}")
    return "\n".join(lines)


def draw(sim: Simulation, title: str, out: str, costs: Costs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    pp = len(sim.spans)
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, sim.makespan * 0.14)), 0.45 * pp + 1.3))

    def box(x, y, width, kind, chunk, label):
        ax.add_patch(Rectangle((x, y), width, 0.8, facecolor=COLOURS[kind][chunk], edgecolor="white", lw=0.5))
        ax.text(x + width / 2, y + 0.4, label, ha="center", va="center", fontsize=6)

    def parts(a, x, y, width):
        """Draw a compute action's parts in [x, x+width): a BW is B then W, an F&B is F then BW."""
        full = costs.of_bw()
        if a.kind is Kind.FB:
            wf = width * costs.f / (costs.f + full)
            parts(a.parts()[0], x, y, wf)
            parts(a.bwd, x + wf, y, width - wf)
            ax.add_patch(Rectangle((x, y), width, 0.8, fill=False, edgecolor="black", lw=1.2))
        elif a.kind is Kind.BW:
            wb = width * costs.b / full
            box(x, y, wb, Kind.B, a.chunk, str(a.mb))
            box(x + wb, y, width - wb, Kind.W, a.chunk, "")
        else:
            box(x, y, width, a.kind, a.chunk, str(a.mb))

    for r, spans in enumerate(sim.spans):
        for s in spans:
            if s.action.is_compute:
                parts(s.action, s.start, pp - 1 - r + 0.1, s.end - s.start)
    ax.set_xlim(0, sim.makespan)
    ax.set_ylim(0, pp)
    ax.set_yticks([pp - 1 - r + 0.5 for r in range(pp)], [f"rank {r}" for r in range(pp)], fontsize=7)
    ax.set_xlabel("time", fontsize=7)
    ax.tick_params(axis="x", labelsize=6)
    ax.set_title(title, fontsize=8)
    handles = [Patch(facecolor=COLOURS[k][c], label=f"{k.value} chunk {c}") for k in COLOURS for c in (0, 1)]
    handles.append(Patch(facecolor="white", edgecolor="black", label="F&B (overlapped)"))
    fig.legend(handles=handles, ncol=7, fontsize=6, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="dualpipe")
    parser.add_argument("--pp", type=int, default=8, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=20)
    parser.add_argument("--out", default=None, help="PNG to write (default: print only)")
    parser.add_argument("--f", type=float, default=2.0, help="forward cost of one chunk")
    parser.add_argument("--b", type=float, default=2.0, help="input-gradient backward cost (full B = b + w)")
    parser.add_argument("--w", type=float, default=1.0, help="weight-gradient backward cost")
    parser.add_argument("--fb", type=float, default=None, help="overlapped F&B cost (default F + b + w)")
    parser.add_argument("--p2p", type=float, default=0.0, help="latency of one transfer")
    args = parser.parse_args(argv)
    costs = Costs(f=args.f, b=args.b, w=args.w, fb=args.fb, p2p=args.p2p)
    try:
        schedule = get_schedule(args.schedule, args.pp, args.microbatches)
        sim = simulate(schedule, costs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(schedule, costs, sim))
    if args.out:
        title = (f"{args.schedule}, pp={args.pp}, {args.microbatches} micro-batches: bubble {sim.max_bubble:g} "
                 f"(formula {table_bubble(args.schedule, args.pp, costs):g}), makespan {sim.makespan:g}")
        draw(sim, title, args.out, costs)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
