"""A run read without W&B: ``python -m tools.report <run dir> [--out DIR]``.

Reads only the files the trainer writes into its run dir (``trainer/metrics.py``): ``metrics.jsonl`` (one line per
optimizer step), ``eval.jsonl`` (validation losses, per ``data.val_blend`` source too), ``expert_load.jsonl`` (tokens
per expert of each MoE layer / the layer's mean, one line per window of steps), ``train.log`` (the start-up lines,
resumes, rollbacks, skipped steps, stops, the last line) and ``config.yaml`` (the resolved config of the latest
start). Writes into ``<run dir>/report/`` (or ``DIR``): one PNG per plot (loss and validation loss,
learning rate, gradient norm, tokens/s and MFU, expert load, step time by phase, the pipeline bubble when pp > 1;
a plot whose metrics the run lacks is left out) and a one-page summary, ``report.md`` and ``report.html`` (the
same text; images referenced relatively, so the folder travels whole). W&B is never imported or read.

The expert plot is a heatmap of ``expert_load.jsonl`` (x: the windows' end steps; y: every MoE layer's experts, one
band per layer) above the worst MoE layer's max / mean load per step from ``metrics.jsonl`` (alone, and the
summary says so, for a run dir without ``expert_load.jsonl``).

``metrics.jsonl`` holds one timeline (a resume or a rollback first cuts it back to its step); a step found twice
anyway keeps its last line, and lines that do not parse (a torn last line) are dropped and counted. A path that is
not a run dir (neither ``metrics.jsonl`` nor ``train.log`` in it) is one line and exit 2, as is an ``--out`` that
cannot be written.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

EXIT_USAGE = 2   # trainer.lifecycle.EXIT_CONFIG: a user error, one line

# train.log lines the summary reports (trainer/train.py, trainer/startup.py, trainer/metrics.py write them).
EVENTS = {
    "resume": re.compile(r"^resumed from (?P<ckpt>\S+) at step (?P<step>\d+)"),
    "rollback": re.compile(r"^step (?P<bad>\d+): rolled back to step (?P<step>\d+)"),
    "skipped": re.compile(r"^step (?P<step>\d+): non-finite loss or gradients"),
    "unhealthy": re.compile(r"^step (?P<step>\d+): unhealthy: "),
    "straggler": re.compile(r"^step (?P<step>\d+): rank (?P<rank>\d+) is a straggler"),
    "stop": re.compile(r"^stopping at step (?P<step>\d+) on request \((?P<signal>[^)]*)\)"),
}
CSS = "body{font-family:sans-serif;max-width:900px;margin:auto}li{font-family:monospace;font-size:90%}"
END = re.compile(r"^(done: step|stopped at step|nothing to do:)")


@dataclass
class Run:
    dir: Path
    metrics: list[dict]
    evals: list[dict]
    log: list[str]
    config: dict
    loads: list[dict] = field(default_factory=list)         # expert_load.jsonl: one row per window of steps
    dropped: dict[str, int] = field(default_factory=dict)   # file -> lines that did not parse

    def events(self, kind: str) -> list[re.Match]:
        return [m for m in (EVENTS[kind].match(line) for line in self.log) if m]

    def last_line(self, prefix: str) -> str | None:
        return next((line for line in reversed(self.log) if line.startswith(prefix)), None)


# ---- reading ---------------------------------------------------------------------------------------
def read_rows(path: Path) -> tuple[list[dict], int]:
    """(rows sorted by step, one per step: the last line of a step wins; lines that did not parse)."""
    if not path.is_file():
        return [], 0
    by_step, bad = {}, 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            bad += 1
    return [by_step[s] for s in sorted(by_step)], bad


def read_run(run_dir: Path) -> Run:
    metrics, bad_m = read_rows(run_dir / "metrics.jsonl")
    evals, bad_e = read_rows(run_dir / "eval.jsonl")
    loads, bad_l = read_rows(run_dir / "expert_load.jsonl")
    log_path, cfg_path = run_dir / "train.log", run_dir / "config.yaml"
    log = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    try:
        config = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else {}
    except yaml.YAMLError:
        config = {}
    dropped = {name: n for name, n in (("metrics.jsonl", bad_m), ("eval.jsonl", bad_e), ("expert_load.jsonl", bad_l))
               if n}
    return Run(run_dir, metrics, evals, log, config if isinstance(config, dict) else {}, load_windows(loads), dropped)


def load_windows(rows: list[dict]) -> list[dict]:
    """The ``expert_load.jsonl`` rows of one shape (the last row's: a run resumed with another model starts
    anew)."""
    def shape(r):
        grid = r.get("load_over_mean")
        return [len(layer) for layer in grid] if isinstance(grid, list) and all(isinstance(x, list) for x in grid) \
            else None
    want = shape(rows[-1]) if rows else None
    return [r for r in rows if want and shape(r) == want]


def num(x) -> float:
    """A metric value as a float; missing or null (non-finite in the run) is NaN."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have ``key``."""
    picked = [r for r in rows if key in r]
    return [int(r["step"]) for r in picked], [num(r[key]) for r in picked]


def finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


# ---- plots -----------------------------------------------------------------------------------------
def _axes(title: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg   # Agg: no display, no pyplot state
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _heatmap_axes(run: Run, title: str, ylabel: str):
    """``_axes`` for the expert plot with ``plot_load_heatmap`` above it (x shared: steps)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    n_rows = sum(len(layer) for layer in run.loads[-1]["load_over_mean"])
    fig = Figure(figsize=(8, 4 + min(6.0, 1.0 + 0.03 * n_rows)), dpi=100)
    FigureCanvasAgg(fig)
    top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[min(6.0, 1.0 + 0.03 * n_rows), 4])
    plot_load_heatmap(run, fig, top)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _line(ax, rows: list[dict], key: str, label: str, **style) -> bool:
    steps, values = series(rows, key)
    if not finite(values):
        return False
    ax.plot(steps, values, label=label, **style)
    return True


def _restarts(ax, run: Run) -> None:
    """Dotted lines where the timeline restarted: resumes and rollbacks (their target step)."""
    for kind, color in (("resume", "tab:gray"), ("rollback", "tab:red")):
        for i, m in enumerate(run.events(kind)):
            ax.axvline(int(m["step"]), color=color, linestyle=":", label=kind if i == 0 else None)


def plot_loss(run: Run, ax) -> bool:
    drawn = _line(ax, run.metrics, "loss", "train loss")
    drawn |= _line(ax, run.metrics, "mtp_loss", "MTP loss", alpha=0.7)
    drawn |= _line(ax, run.evals, "val_loss", "val_loss", marker="o")
    for key in sorted({k for r in run.evals for k in r if k.startswith("val_loss/")}):
        drawn |= _line(ax, run.evals, key, key, marker=".", linestyle="--")
    if drawn:
        _restarts(ax, run)
    return drawn


def plot_grad_norm(run: Run, ax) -> bool:
    drawn = _line(ax, run.metrics, "grad_norm", "grad norm")
    if drawn and min(finite(series(run.metrics, "grad_norm")[1])) > 0:
        ax.set_yscale("log")
    return drawn


def plot_throughput(run: Run, ax) -> bool:
    drawn = _line(ax, run.metrics, "tokens_per_s", "tokens/s")
    steps, mfu = series(run.metrics, "mfu")
    if drawn and finite(mfu):
        twin = ax.twinx()
        twin.plot(steps, [100 * v for v in mfu], color="tab:orange", label="MFU")
        twin.set_ylabel("MFU (%)")
        twin.legend(loc="lower right", fontsize=8)
    return drawn


def plot_experts(run: Run, ax) -> bool:
    drawn = _line(ax, run.metrics, "max_expert_load_over_mean", "worst MoE layer: max / mean tokens per expert")
    if drawn:
        ax.axhline(1.0, color="tab:gray", linestyle=":", label="balanced")
    return drawn


def plot_load_heatmap(run: Run, fig, ax) -> None:
    """``expert_load.jsonl`` as an image: one column per window (at its end step), one row per expert of each MoE
    layer (layer 0 on top, white lines between layers); colour: load / layer mean (1 = balanced)."""
    import numpy as np
    grid = np.array([[num(v) for layer in r["load_over_mean"] for v in layer] for r in run.loads]).T   # [L*E, windows]
    layers = run.loads[-1]["load_over_mean"]
    ends = [int(r["step"]) for r in run.loads]
    starts = [int(r.get("from_step", s)) for r, s in zip(run.loads, ends)]
    edges = [starts[0] - 0.5] + [e + 0.5 for e in ends]   # columns span their windows' steps
    vmax = max(2.0, float(np.nanmax(grid))) if np.isfinite(grid).any() else 2.0
    mesh = ax.pcolormesh(edges, np.arange(grid.shape[0] + 1) - 0.5, np.ma.masked_invalid(grid), cmap="magma",
                         vmin=0.0, vmax=vmax, shading="flat")
    ax.set_ylim(grid.shape[0] - 0.5, -0.5)
    bounds = np.cumsum([len(layer) for layer in layers])
    for b in bounds[:-1]:
        ax.axhline(b - 0.5, color="white", linewidth=1)
    ax.set_yticks(bounds - np.array([len(layer) for layer in layers]) / 2 - 0.5,
                  [f"MoE {i}" for i in range(len(layers))], fontsize=7 if len(layers) > 12 else 9)
    ax.set_ylabel("experts of each MoE layer")
    ax.set_title(f"Expert load / layer mean over each window ({len(layers)} MoE layers x {len(layers[0])} experts)")
    fig.colorbar(mesh, cax=ax.inset_axes([1.01, 0.0, 0.015, 1.0]), label="load / mean")   # keeps x aligned


def plot_step_time(run: Run, ax) -> bool:
    drawn = _line(ax, run.metrics, "step_time_s", "step", linewidth=2)
    for key in sorted({k for r in run.metrics for k in r if k.startswith("time_") and k.endswith("_s")}):
        drawn |= _line(ax, run.metrics, key, key.removeprefix("time_").removesuffix("_s"), alpha=0.8)
    return drawn


def plot_bubble(run: Run, ax) -> bool:
    drawn = _line(ax, run.metrics, "pipeline_bubble_measured", "measured (rank 0)")
    drawn |= _line(ax, run.metrics, "pipeline_bubble_simulated", "simulated (measured costs)", linestyle="--")
    return drawn


# file, title, y label, draw(run, ax) -> whether it had data
PLOTS = [
    ("loss.png", "Loss (train, MTP, validation)", "loss", plot_loss),
    ("lr.png", "Learning rate", "lr", lambda run, ax: _line(ax, run.metrics, "lr", "lr")),
    ("grad_norm.png", "Gradient norm (before clipping)", "grad norm", plot_grad_norm),
    ("throughput.png", "Throughput", "tokens/s (all ranks)", plot_throughput),
    ("experts.png", "Expert load imbalance", "max / mean load", plot_experts),
    ("step_time.png", "Step time by phase (rank 0)", "seconds", plot_step_time),
    ("pipeline_bubble.png", "Pipeline bubble (pp > 1)", "idle share of the step", plot_bubble),
]


def draw_plots(run: Run, out: Path) -> list[tuple[str, str]]:
    """Writes each plot the run has data for; returns [(file, title)]."""
    written = []
    for name, title, ylabel, draw in PLOTS:
        if name == "experts.png" and run.loads:
            fig, ax = _heatmap_axes(run, title, ylabel)
        else:
            fig, ax = _axes(title, ylabel)
        if not draw(run, ax):
            continue
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left" if name == "throughput.png" else "best")
        fig.tight_layout()
        fig.savefig(out / name)
        written.append((name, title))
    return written


# ---- the summary -----------------------------------------------------------------------------------
def _get(cfg: dict, dotted: str, default="?"):
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return default
        cfg = cfg[part]
    return cfg


def preset_name(model: dict) -> str | None:
    """The ``configs/model`` preset the run's model equals, if any (for naming only)."""
    import dataclasses
    from configs.presets import MODEL_DIR, model_preset
    for path in sorted(MODEL_DIR.glob("*.yaml")):
        try:
            if dataclasses.asdict(model_preset(path.stem)) == model:
                return path.stem
        except Exception:   # noqa: BLE001 - a name is never worth failing over
            continue
    return None


def config_lines(run: Run) -> list[str]:
    c = run.config
    if not c:
        return ["no config.yaml in the run dir"] + [x for x in (run.last_line("layout:"), run.last_line("model:")) if x]
    m = c.get("model") or {}
    preset = preset_name(m) if m else None
    lines = [f"model: {'preset ' + preset if preset else 'custom'} (dim {m.get('dim', '?')}, {m.get('n_layers', '?')} "
             f"layers, {m.get('n_routed_experts', '?')} routed experts, top-{m.get('n_activated_experts', '?')}, "
             f"MTP depth {m.get('mtp_depth', '?')}, vocab {m.get('vocab_size', '?')})"]
    size = run.last_line("model:")
    if size:
        lines.append("size: " + size.removeprefix("model: "))
    lines.append(run.last_line("layout:") or
                 "layout: pp {} x ep {}; schedule {}; zero {}".format(*(_get(c, f"parallel.{k}") for k in
                                                                        ("pp", "ep", "schedule", "zero"))))
    lines.append(f"precision: {_get(c, 'train.precision')}; recompute {_get(c, 'train.recompute')}")
    lines.append(f"batch: {_get(c, 'train.global_batch_size')} sequences x {_get(c, 'data.seq_len')} tokens per "
                 f"step (micro-batch {_get(c, 'train.micro_batch_size')})")
    lines.append(f"steps: train.max_steps={_get(c, 'train.max_steps')}, stop_at_step="
                 f"{_get(c, 'train.stop_at_step')}, eval_every={_get(c, 'train.eval_every')}")
    lines.append(f"optimizer: lr {_get(c, 'optim.lr')} -> {_get(c, 'optim.min_lr')} ({_get(c, 'optim.decay')}, "
                 f"warmup {_get(c, 'optim.warmup_steps')} steps)")
    data = run.last_line("data:")
    if data:
        lines.append(data)
    return lines


def _best(rows: list[dict], key: str) -> tuple[float, int] | None:
    pairs = [(num(r[key]), int(r["step"])) for r in rows if key in r and math.isfinite(num(r[key]))]
    return min(pairs) if pairs else None


def result_lines(run: Run) -> list[str]:
    if not run.metrics:
        return ["no step finished: metrics.jsonl has no rows"]
    last = run.metrics[-1]
    max_steps = _get(run.config, "train.max_steps")
    lines = [f"steps: {last['step']} of {max_steps}" + (f"; {int(num(last['tokens'])):,} tokens"
                                                        if "tokens" in last else ""),
             f"final loss: {num(last.get('loss')):.4f} (step {last['step']})"
             + (f"; MTP loss {num(last['mtp_loss']):.4f}" if "mtp_loss" in last else "")]
    best = _best(run.metrics, "loss")
    if best:
        lines.append(f"best loss: {best[0]:.4f} (step {best[1]})")
    if not run.evals:
        lines.append("validation: none in eval.jsonl (validation off, or the run ended before the first one)")
        return lines
    final = run.evals[-1]
    lines.append(f"final val_loss: {num(final.get('val_loss')):.4f} (step {final['step']})")
    best = _best(run.evals, "val_loss")
    if best:
        lines.append(f"best val_loss: {best[0]:.4f} (step {best[1]}); first {num(run.evals[0].get('val_loss')):.4f} "
                     f"(step {run.evals[0]['step']})")
    sources = {k: v for k, v in final.items() if k.startswith("val_loss/")}
    if sources:
        lines.append("final val_loss per source: " + ", ".join(f"{k[9:]} {num(v):.4f}" for k, v in sources.items()))
    return lines


def _median(rows: list[dict], key: str) -> float | None:
    values = finite(series(rows, key)[1])
    return statistics.median(values) if values else None


def throughput_lines(run: Run) -> list[str]:
    rows = [r for r in run.metrics if not r.get("skipped")]
    tok, dt = _median(rows, "tokens_per_s"), _median(rows, "step_time_s")
    if tok is None:
        return ["no throughput: no step finished"]
    lines = [f"median tokens/s: {tok:,.0f} over {len(rows)} steps" + (f" (median step {dt:.3g} s)" if dt else "")]
    mfu, tflops = _median(rows, "mfu"), _median(rows, "tflops_per_rank")
    lines.append(f"median MFU: {100 * mfu:.1f}%" if mfu is not None else
                 "MFU: n/a (the device's peak was unknown; set logging.peak_tflops)")
    if tflops is not None:
        lines.append(f"median achieved: {tflops:.3g} TFLOP/s per rank")
    mem = finite(series(rows, "mem_peak_gb")[1])
    if mem:
        lines.append(f"peak memory: {max(mem):.2f} GB (max over ranks and steps)")
    measured, simulated = _median(rows, "pipeline_bubble_measured"), _median(rows, "pipeline_bubble_simulated")
    if measured is not None:
        lines.append(f"pipeline bubble: median {measured:.1%} measured (rank 0)"
                     + (f", {simulated:.1%} simulated" if simulated is not None else ""))
    skew = [(v, r.get("slowest_rank")) for r in rows if math.isfinite(v := num(r.get("rank_skew")))]
    if skew:
        worst = max(skew, key=lambda x: x[0])
        lines.append(f"rank skew (slowest rank's compute over the median's): median "
                     f"{statistics.median(v for v, _ in skew):.0%}, worst {worst[0]:.0%} (rank {worst[1]})")
    phases = {k.removeprefix("time_").removesuffix("_s"): _median(rows, k) for k in rows[-1]
              if k.startswith("time_") and k.endswith("_s")}
    if phases:
        lines.append("median phase seconds: " + ", ".join(f"{k} {v:.3g}" for k, v in phases.items() if v is not None))
    return lines


def _steps(matches: list[re.Match], limit: int = 8) -> str:
    steps = [m["step"] for m in matches]
    return ", ".join(steps[:limit]) + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def event_lines(run: Run) -> list[str]:
    """What train.log says about restarts, rollbacks, skipped steps, stops and how the run ended."""
    if not run.log:
        return ["no train.log in the run dir"]
    lines = [f"resumed {len(r)}x: " + "; ".join(f"at step {m['step']} from {m['ckpt']}" for m in r)
             for r in [run.events("resume")] if r]
    lines += [f"rollbacks: {len(r)}: " + "; ".join(f"step {m['bad']} back to step {m['step']}" for m in r)
              for r in [run.events("rollback")] if r]
    for kind, what in (("skipped", "skipped steps (non-finite loss or gradients)"),
                       ("unhealthy", "unhealthy steps (health guard)")):
        found = run.events(kind)
        lines.append(f"{what}: {len(found)}" + (f" (steps {_steps(found)})" if found else ""))
    lines += [f"straggler: rank {m['rank']} at step {m['step']}" for m in run.events("straggler")]
    lines += [f"stop on request at step {m['step']} ({m['signal']})" for m in run.events("stop")]
    end = next((line for line in reversed(run.log) if END.match(line)), None)
    last = run.metrics[-1]["step"] if run.metrics else 0
    lines.append(f"last line: {end}" if end else
                 f"no end line in train.log: the run is still going, or it was killed or failed (its error is in the "
                 f"job's output); the last step logged is {last}")
    return lines


def note_lines(run: Run, images: list[tuple[str, str]]) -> list[str]:
    notes = [f"{name}: {n} line(s) that did not parse (a torn last line) left out" for name, n in run.dropped.items()]
    if run.loads:
        notes.append(f"expert load: experts.png shows expert_load.jsonl ({len(run.loads)} windows, the last steps "
                     f"{run.loads[-1].get('from_step', '?')}-{run.loads[-1]['step']}) above "
                     "max_expert_load_over_mean, the worst MoE layer's max / mean load per step")
    elif "max_expert_load_over_mean" in (run.metrics[-1] if run.metrics else {}):
        wandb = run.last_line("W&B:")
        notes.append("expert load: no expert_load.jsonl in the run dir (W&B gets the tokens per expert: "
                     "experts/moe0_load, moe1_load, ..., experts/load_heatmap" + (f"; {wandb}" if wandb else "")
                     + "), so experts.png plots max_expert_load_over_mean, the worst MoE layer's max / mean load, "
                     "per step")
    if not any(name == "pipeline_bubble.png" for name, _ in images) and num(_get(run.config, "parallel.pp", 1)) > 1:
        notes.append("pipeline bubble: no pipeline_bubble_* values in metrics.jsonl")
    return notes


def sections(run: Run, images: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    return [("Configuration", config_lines(run)), ("Results", result_lines(run)),
            ("Throughput", throughput_lines(run)), ("Events (train.log)", event_lines(run)),
            ("Notes", note_lines(run, images))]


def render_md(title: str, parts: list[tuple[str, list[str]]], images: list[tuple[str, str]]) -> str:
    out = [f"# {title}", ""]
    for heading, lines in parts:
        if lines:
            out += [f"## {heading}", *[f"- {line}" for line in lines], ""]
    out += ["## Plots", ""] + [f"![{t}]({name})\n" for name, t in images]
    return "\n".join(out)


def render_html(title: str, parts: list[tuple[str, list[str]]], images: list[tuple[str, str]]) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>"]
    for heading, lines in parts:
        if lines:
            body += [f"<h2>{e(heading)}</h2>", "<ul>", *[f"<li>{e(line)}</li>" for line in lines], "</ul>"]
    body += ["<h2>Plots</h2>"] + [f'<p><img src="{e(name)}" alt="{e(t)}" width="800"></p>' for name, t in images]
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{e(title)}</title>\n<style>{CSS}</style>'
            "</head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


# ---- entry point -----------------------------------------------------------------------------------
def write_report(run_dir: Path, out: Path) -> list[tuple[str, str]]:
    """The plots and report.md / report.html of ``run_dir`` in ``out``; returns the plots [(file, title)]."""
    run = read_run(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = draw_plots(run, out)
    for name, *_ in PLOTS:   # a plot of an earlier report that this run no longer has data for
        if name not in dict(images):
            (out / name).unlink(missing_ok=True)
    title = f"Run report: {run_dir.resolve()}"
    parts = sections(run, images)
    (out / "report.md").write_text(render_md(title, parts, images))
    (out / "report.html").write_text(render_html(title, parts, images))
    return images


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="the trainer's run dir (hydra.run.dir)")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: <run dir>/report)")
    args = ap.parse_args(argv)
    run_dir = args.run_dir
    if not run_dir.is_dir() or not any((run_dir / f).is_file() for f in ("metrics.jsonl", "train.log")):
        print(f"error: {run_dir}: not a run dir (no metrics.jsonl or train.log in it); pass the directory a trainer "
              "run wrote (hydra.run.dir)", file=sys.stderr)
        return EXIT_USAGE
    out = args.out or run_dir / "report"
    try:
        images = write_report(run_dir, out)
    except OSError as e:
        from errors import os_error
        print(f"error: --out: writing the report to {out} failed: {os_error(e)}; pass a writable --out DIR",
              file=sys.stderr)
        return EXIT_USAGE
    print(f"report: {out / 'report.md'} and report.html, {len(images)} plots: {', '.join(n for n, _ in images)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
