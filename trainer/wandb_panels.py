"""The Weights & Biases side of ``trainer.metrics.MetricsLogger`` (rank 0; offline by default).

Panels are grouped by the metric name's prefix (W&B makes one section per prefix: ``train/``, ``throughput/``,
``time/``, ``experts/``, ``comm/``, ``pipeline/``, ``health/``, ``memory/``); ``panel_name`` maps the keys, and
docs/operations.md lists every panel.

The run id is passed to ``wandb.init(id=..., resume="allow")``: a resumed run continues the same W&B run.
Offline, every start writes its own ``offline-run-<time>-<id>`` dir with that id; ``wandb sync`` uploads
them in order into one run. ``WandbPanels.close()`` returns only once W&B's service has written the whole
log: ``wandb.finish()`` does not wait for that (see ``trainer.wandb_log.wait_for_transaction_log``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from .expert_load import Window
from .wandb_log import wait_for_transaction_log

WANDB_CLOSE_TIMEOUT_S = 120.0      # how long close() waits for W&B's service to write the run's log


def panel_name(key: str) -> str:
    """W&B name (``group/metric``) of a ``metrics.jsonl`` key."""
    if key in ("tokens_per_s", "step_time_s", "tflops_per_rank", "mfu"):
        return f"throughput/{key}"
    if key == "max_expert_load_over_mean":
        return "experts/max_over_mean"
    if key.startswith("ep_"):
        return "comm/" + key[3:]
    if key.startswith("mem_"):
        return "memory/" + key[4:]
    if key.startswith("pipeline_"):
        return "pipeline/" + key[9:]
    if key.startswith("time_"):
        return "time/" + key[5:]
    if key in ("rank_skew", "slowest_rank"):   # not seconds of a phase: named apart from the time_<phase>_s keys
        return "time/" + key
    if key == "val_loss":
        return "val/loss"
    if key.startswith("val_loss/"):
        return "val/loss_" + key[9:]
    if key.startswith("tokens/"):
        return "data/tokens_" + key[7:]
    if key == "skipped_windows":
        return "data/skipped_windows"
    if key in ("unhealthy", "rollbacks"):
        return "health/" + key
    return f"train/{key}"


def run_name(cfg: dict, world_size: int) -> str:
    """Default W&B run name: the experiment (``+exp=...``; else the model's shape) and the layout, e.g.
    ``tiny-pp2-ep2-dp2-dualpipe-zero1-fp32``."""
    exp = None
    try:
        from hydra.core.hydra_config import HydraConfig
        if HydraConfig.initialized():
            exp = HydraConfig.get().runtime.choices.get("exp")
    except Exception:   # noqa: BLE001 - a name is never worth failing over
        exp = None
    m, p, t = cfg["model"], cfg["parallel"], cfg["train"]
    parts = [exp or f"d{m['dim']}-l{m['n_layers']}-e{m['n_routed_experts']}"]
    parts += [f"pp{p['pp']}"] * (p["pp"] > 1) + [f"ep{p['ep']}"] * (p["ep"] > 1)
    parts += [f"dp{max(1, world_size // p['pp'])}"] + [p["schedule"]] * (p["pp"] > 1)
    parts += [f"zero{p['zero']}"] * (p["zero"] > 0) + [t["precision"]]
    return "-".join(parts)


def wandb_mode(configured: str) -> tuple[str, str | None]:
    """(the W&B mode this run uses, a log line or None): ``$WANDB_MODE`` wins over ``logging.wandb.mode`` (W&B's own
    switch, e.g. ``WANDB_MODE=disabled`` in a job script; ``configs.checks`` checked its value)."""
    env = os.environ.get("WANDB_MODE")
    if not env or env == configured:
        return configured, None
    return env, f"W&B: WANDB_MODE={env} in the environment wins over logging.wandb.mode={configured}"


def start_run(wandb_cfg, mode: str, config_dict: dict, run_dir: Path, run_id: str, world_size: int, summary: dict,
              write: Callable[[str], None]):
    """``wandb.init`` for ``logging.wandb`` in ``mode`` (``wandb_mode``; offline instead of online when no API key
    or login is found), with ``summary`` in the run's summary; ``write`` gets one line saying where the run is and
    how to read it without a browser."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb
    if mode == "online" and not (os.environ.get("WANDB_API_KEY") or _netrc_has_wandb()):
        write("logging.wandb.mode=online but neither WANDB_API_KEY nor a `wandb login` was found: logging "
              f"offline to {run_dir / 'wandb'} (upload later with `wandb sync`)")
        mode = "offline"
    # One W&B run per run lineage: a resumed run continues it (online; offline, see the module doc).
    run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity,
                     name=wandb_cfg.name or run_name(config_dict, world_size),
                     tags=list(wandb_cfg.tags), mode=mode, dir=str(run_dir), config=config_dict,
                     id=run_id, resume="allow")
    run.summary.update(summary)
    where = run.settings.sync_dir
    write(f"W&B: {mode} run {where}" + (f" ({run.url})" if run.url else "") + f"; view it in a terminal with `wandb "
          f"leet {where}`" + (f", upload it with `wandb sync {where}`" if mode == "offline" else ""))
    return run


class WandbPanels:
    """One W&B run's panels: the step rows (``panel_name``), memory per rank, cross-node traffic per token,
    expert-load histograms, and a heatmap of each expert-load window the logger closes (``trainer.expert_load``).
    ``static``: values logged once with the first row (its ``pipeline/`` ones; all of them are in the summary)."""

    def __init__(self, run, static: dict, start_step: int):
        self.run = run
        self.static = static
        self._static_logged = False
        self._max_step = start_step   # W&B drops (with a warning line each) what is logged to an earlier step

    def _log(self, values: dict, step: int) -> None:
        """After a rollback the trainer redoes steps that W&B already has: those keep their first values there
        (``metrics.jsonl`` holds the redone ones); W&B gets rows again from the first step past them."""
        if step >= self._max_step:
            self._max_step = step
            self.run.log(values, step=step)

    def log_step(self, row: dict, loads: list[torch.Tensor], step_tokens: int, window: Window | None = None) -> None:
        """Log a ``metrics.jsonl`` row; ``loads``: tokens per expert of each MoE layer; ``step_tokens``: the
        step's tokens; ``window``: the expert-load window this step closed, if any (a heatmap)."""
        if row["step"] >= self._max_step:
            self._log(self._row(row, loads, step_tokens, window), row["step"])

    def _row(self, row: dict, loads: list[torch.Tensor], step_tokens: int, window: Window | None) -> dict:
        out = {}
        for k, v in row.items():
            if k == "step" or k == "mem_peak_gb_per_rank":
                continue
            out[panel_name(k)] = v
        for r, gb in enumerate(row.get("mem_peak_gb_per_rank", [])):
            out[f"memory/rank{r}_peak_gb"] = gb
        if "ep_cross_node_tokens" in row and loads:
            out["comm/cross_node_per_token"] = row["ep_cross_node_tokens"] / (step_tokens * len(loads))
        if not self._static_logged:   # once, so that the value gets a panel (it is in the summary too)
            out |= {k: v for k, v in self.static.items() if k.startswith("pipeline/")}
            self._static_logged = True
        for i, load in enumerate(loads):
            mean = load.mean().clamp_min(1e-9)
            out[f"experts/moe{i}_max_over_mean"] = float(load.max() / mean)
            out[f"experts/moe{i}_min_over_mean"] = float(load.min() / mean)
            out[f"experts/moe{i}_load"] = _histogram(load)
        if window is not None:
            out["experts/load_heatmap"] = _heatmap(window, row["step"])
        return out

    def log_eval(self, step: int, val_loss: float, per_source: dict[str, float]) -> None:
        self._log({"val/loss": val_loss} | {panel_name(k): v for k, v in per_source.items()}, step)

    def update_summary(self, values: dict) -> None:
        self.run.summary.update(values)

    def close(self, last_step: int, write: Callable[[str], None], window: Window | None = None) -> None:
        """Draw the pending heatmap (``window``: a run stopped between two), finish the run and wait until its log
        is written out (``write`` says so when that takes over ``WANDB_CLOSE_TIMEOUT_S``)."""
        if window is not None and last_step >= self._max_step:
            self.run.log({"experts/load_heatmap": _heatmap(window, last_step)}, step=last_step)
        log = Path(self.run.settings.sync_file)
        self.run.finish()
        if not wait_for_transaction_log(log, WANDB_CLOSE_TIMEOUT_S):
            write(f"metrics: W&B's service had not finished writing {log} after "
                  f"{WANDB_CLOSE_TIMEOUT_S:.0f}s; the offline run may lack its last records")


def _histogram(load: torch.Tensor):
    import wandb
    # One bar per expert: tokens routed to expert i.
    return wandb.Histogram(np_histogram=(load.numpy(), list(range(len(load) + 1))))


def _heatmap(window: Window, step: int):
    import wandb
    from_step, rel_LE = window
    return wandb.Image(expert_load_heatmap(rel_LE, f"expert load / layer mean, steps {from_step}-{step}"))


def expert_load_heatmap(rel_LE: torch.Tensor, title: str):
    """RGB image (numpy uint8 [H, W, 3]) of load / layer mean (``expert_load.load_over_mean``): one row per MoE
    layer (L), one column per expert (E)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rel = rel_LE.numpy()
    n_layers, n_experts = rel.shape
    fig = Figure(figsize=(min(16.0, 2.5 + 0.06 * n_experts), min(12.0, 1.6 + 0.22 * n_layers)), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    vmax = max(2.0, float(rel.max()))
    im = ax.imshow(rel, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax, interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _netrc_has_wandb() -> bool:
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in path.read_text()
    except OSError:
        return False
