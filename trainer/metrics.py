"""Step metrics: ``metrics.jsonl`` in the run dir, Weights & Biases (``trainer.wandb_panels``), tqdm on rank 0.

FLOPs per token (training, forward + backward; ``models.params.flops_per_token``) is the basis of MFU:
MFU = tokens_per_s * FLOPs per token / (world size * peak FLOP/s per device). The peak is dense BF16
tensor-core FLOP/s from ``PEAK_FLOPS`` by device name, or ``$DSV3_PEAK_TFLOPS`` (TFLOP/s per device;
set it for a GPU not in the table, or to compare a CPU against a peak you choose).

``metrics.jsonl`` / ``eval.jsonl`` hold one strict-JSON line per step (non-finite numbers as ``null``);
``expert_load.jsonl`` one per expert-load window (``trainer.expert_load``: every ``heatmap_every`` steps and at
the last one, the windows of W&B's heatmap): ``{"step": N, "from_step": M, "load_over_mean": [[per expert] per
MoE layer]}``, each layer's tokens per expert over steps M..N / their mean, 4 decimals. A run that resumes from a
checkpoint at step k first cuts all three back to step k, so the steps it redoes appear once (a rollback too).
The W&B run id is chosen once per run lineage (``$WANDB_RUN_ID``, else the id saved in the checkpoint being
resumed, else a new one) and written into every checkpoint (``wandb_run_id.txt``): a resumed run
continues the same W&B run. Offline runs can be read back without network with
``trainer.wandb_log.read_offline_run``.

Every file written here is under the run dir; a write that fails (disk full, read-only) ends the run with one
``errors.WriteError`` line naming the file, what it held and what to do (``run_dir_writing``), exit 2.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from data import micro_batches
from errors import writing
from models.params import FLOPS_FORMULA, flops_per_token

from .expert_load import LoadWindow, Window
from .wandb_panels import WandbPanels, start_run, wandb_mode

# Dense (no sparsity) BF16 tensor-core peak per device, FLOP/s. First substring match of the CUDA
# device name wins, so the more specific names come first.
PEAK_FLOPS: list[tuple[str, float]] = [
    ("GH200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("H200", 989e12),
    ("H20", 148e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
]
PER_RANK_LIMIT = 64   # log memory/rank<r>_peak_gb for worlds up to this size
RUN_ID_FILE = "wandb_run_id.txt"   # in every checkpoint dir: the W&B run id of the run that wrote it
# The run dir's step files (a resume or a rollback cuts each back): file name, what it holds.
STEP_FILES = {"metrics.jsonl": "the step metrics", "eval.jsonl": "the validation losses",
              "expert_load.jsonl": "the expert loads"}
RUN_DIR_FIX = ("Free space on its disk (or fix its permissions) and run again: checkpoint.resume=auto continues from "
               "the newest checkpoint, which this did not touch")


def run_dir_writing(path: Path, what: str):
    """``errors.writing`` for a file in the run dir (``hydra.run.dir``): an OSError inside is one line, exit 2."""
    return writing("hydra.run.dir", path, what, RUN_DIR_FIX)


# ---- derived quantities --------------------------------------------------------------------------
def peak_flops(device: torch.device | None, configured_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where it came from): ``logging.peak_tflops``, else $DSV3_PEAK_TFLOPS,
    else the GPU's name in ``PEAK_FLOPS``."""
    if configured_tflops:
        return float(configured_tflops) * 1e12, "logging.peak_tflops"
    env = os.environ.get("DSV3_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12, "$DSV3_PEAK_TFLOPS"
    if device is None or device.type != "cuda":
        return None, f"unknown for {device.type if device is not None else 'this device'}"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS:
        if key in name:
            return value, name
    return None, f"{name} is not in trainer.metrics.PEAK_FLOPS (set logging.peak_tflops)"


def rank_memory(device: torch.device, dims) -> dict[str, Any]:
    """Peak memory of every rank (a collective: call on all ranks). CUDA: ``max_memory_allocated``;
    CPU: the process's peak RSS. Returns ``mem_peak_gb`` (max over ranks), ``mem_peak_gb_min``,
    ``mem_peak_rank`` (argmax) and, for worlds up to 64 ranks, ``mem_peak_gb_per_rank``."""
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0   # Linux: KiB
    mine = torch.tensor([peak / 1e9], dtype=torch.float64, device=device)
    if dims.world_size > 1:
        gathered = [torch.zeros_like(mine) for _ in range(dims.world_size)]
        torch.distributed.all_gather(gathered, mine)
        per_rank = torch.cat(gathered).tolist()
    else:
        per_rank = mine.tolist()
    out = {"mem_peak_gb": max(per_rank), "mem_peak_gb_min": min(per_rank),
           "mem_peak_rank": per_rank.index(max(per_rank))}
    if dims.world_size <= PER_RANK_LIMIT:
        out["mem_peak_gb_per_rank"] = [round(x, 4) for x in per_rank]
    return out


def simulated_bubble(schedule: str, pp: int, n_microbatches: int) -> float:
    """Bubble fraction (largest per-rank idle time / makespan) of ``schedule`` from the simulator, unit costs."""
    from parallel.pipeline.schedules import get_schedule
    from parallel.pipeline.simulator import Costs, simulate

    sim = simulate(get_schedule(schedule, pp, n_microbatches), Costs(f=1.0, b=1.0, w=1.0))
    return sim.max_bubble / sim.makespan


def _human(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


# ---- metrics files, run ids ---------------------------------------------------------------------
def _finite(x: Any) -> Any:
    """``x`` with every non-finite float (nan, inf; also inside lists and dicts) replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def json_line(row: dict) -> str:
    """One strict-JSON line: nan/inf become ``null`` (Python's json would write bare ``NaN``)."""
    return json.dumps(_finite(row), allow_nan=False)


def cut_back(path: Path, start_step: int) -> int:
    """Rewrite a ``metrics.jsonl``-style file keeping the lines of steps <= ``start_step`` (none when the run
    starts at step 0): a resumed run redoes the later steps. Lines that do not parse (cut short when a run was
    killed mid-write) go too; kept lines are rewritten as strict JSON. Atomic (temp file + rename). Returns the
    number of lines dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            keep = start_step > 0 and int(row["step"]) <= start_step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(json_line(row))
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with run_dir_writing(path, f"the lines up to step {start_step}"):
            try:
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    return dropped


def new_run_id() -> str:
    """A W&B-style run id (8 characters of [0-9a-z]). From ``secrets``: the ``random`` module's state is part
    of the checkpoint and must not move."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    return "".join(secrets.choice(alphabet) for _ in range(8))


def saved_run_id(checkpoint: str | Path | None) -> str | None:
    """The W&B run id a checkpoint dir was written with (``wandb_run_id.txt``), or None (none saved there)."""
    if checkpoint is None:
        return None
    try:
        return (Path(checkpoint) / RUN_ID_FILE).read_text().strip() or None
    except OSError:
        return None


# ---- the logger ----------------------------------------------------------------------------------
class StragglerWatch:
    """``rank_skew``: (slowest - median) / median of the ranks' compute seconds in the previous step, and
    ``slowest_rank``; names the slowest rank once it stays over logging.straggler_threshold for
    logging.straggler_steps steps in a row (again after it recovered)."""

    def __init__(self, logging_cfg):
        self.cfg = logging_cfg
        self.slow = (None, 0)   # (rank, steps in a row) over logging.straggler_threshold

    def metrics(self, times: list[float] | None, step: int, write: Callable[[str], None]) -> dict:
        if not times:
            return {}
        lg = self.cfg
        median = sorted(times)[(len(times) - 1) // 2]   # the lower one of an even count: with two ranks, the other
        slowest = max(range(len(times)), key=times.__getitem__)
        skew = times[slowest] / median - 1 if median > 0 else 0.0
        rank, n = self.slow
        n = (n + 1 if rank == slowest else 1) if skew > lg.straggler_threshold else 0
        self.slow = (slowest, n)
        if n == lg.straggler_steps:
            write(
                f"step {step}: rank {slowest} is a straggler: its compute took {times[slowest]:.3g} s per step, "
                f"{skew:.0%} over the median rank's {median:.3g} s, for {n} steps in a row (logging.straggler_"
                f"threshold={lg.straggler_threshold:g}); see its node's load, clocks and memory")
        return {"rank_skew": skew, "slowest_rank": slowest}


class MetricsLogger:
    """One per rank; only rank 0 (``is_main``) writes. ``config_dict`` is the full run config as a dict;
    ``device`` and ``world_size`` give MFU and per-rank numbers. ``heatmap_every``: steps between expert-load
    windows, each a W&B heatmap and a line of ``expert_load.jsonl`` (default ``total_steps // 20``; one also at the
    end).

    ``start_step``: the step the run starts from (the resumed checkpoint's); ``metrics.jsonl``, ``eval.jsonl``
    and ``expert_load.jsonl`` are first cut back to it. ``run_id``: the W&B run id saved in that checkpoint
    (``saved_run_id``); ``$WANDB_RUN_ID`` overrides it, and without either a new id is drawn. The id is
    ``self.run_id`` (rank 0), for the trainer to save with each checkpoint."""

    def __init__(self, run_dir: Path, wandb_cfg, config_dict: dict, total_steps: int, start_step: int,
                 progress: bool = True, is_main: bool = True, *, device: torch.device | None = None,
                 world_size: int = 1, heatmap_every: int | None = None, run_id: str | None = None,
                 log_every: int = 0):
        self.is_main = is_main
        self.log_every = log_every     # a plain line every N steps (stdout and <run dir>/train.log); 0: none
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.total_steps = total_steps
        self.run_id = (os.environ.get("WANDB_RUN_ID") or run_id or new_run_id()) if is_main else None
        self._log, self._files = None, {}
        if is_main:
            self._log = self._open("train.log", "the run log")
            cut = {name: cut_back(self.run_dir / name, start_step) for name in STEP_FILES}
            self._open_step_files()
        self.wandb: WandbPanels | None = None
        self.bar = None
        self._last_step = self._first_step = start_step
        self._totals = {"tokens": 0.0, "time": 0.0, "mem_peak_gb": None, "mem_peak_rank": None}
        self._loads = LoadWindow(heatmap_every or max(1, total_steps // 20), total_steps, start_step)
        if not is_main:
            return
        self.seq_len = config_dict["data"]["seq_len"]
        self.step_tokens = config_dict["train"]["global_batch_size"] * self.seq_len   # without a batch ramp
        self.flops, self.peak, self.peak_src, self.static = None, None, "", {}
        self._derive(config_dict, device)
        if any(cut.values()):
            self.write(f"metrics: starting at step {start_step}: dropped the lines after it ("
                       + ", ".join(f"{n} from {name}" for name, n in cut.items() if n) + "); those steps are redone")
        mode, note = wandb_mode(wandb_cfg.mode)
        if note:
            self.write(note)
        if mode != "disabled":
            summary = self.static | {"throughput/flops_formula": FLOPS_FORMULA, "throughput/peak_source": self.peak_src}
            with self._wandb_writing("the W&B run"):
                run = start_run(wandb_cfg, mode, config_dict, self.run_dir, self.run_id, world_size, summary,
                                self.write)
            self.wandb = WandbPanels(run, self.static, start_step)
        if progress and sys.stderr.isatty():   # a bar for terminals; log files get the plain lines
            from tqdm.auto import tqdm
            # ETA from the step rate; redraw rarely when stderr is a log file rather than a terminal.
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            mininterval=0.1 if sys.stderr.isatty() else 30.0)

    def rewind(self, step: int) -> None:
        """After a rollback to ``step``: ``metrics.jsonl``, ``eval.jsonl`` and ``expert_load.jsonl`` cut back to it,
        as on a resume (the steps after it are redone; ``train.log`` keeps the lines that say why)."""
        if not self.is_main:
            return
        for f in self._files.values():
            f.close()
        for name in STEP_FILES:
            cut_back(self.run_dir / name, step)
        self._open_step_files()
        self._loads.restart(step)
        self._last_step = step
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def _open_step_files(self) -> None:
        self._files = {name: self._open(name, what) for name, what in STEP_FILES.items()}

    def _open(self, name: str, what: str):
        with run_dir_writing(self.run_dir / name, what):
            return open(self.run_dir / name, "a")

    def _append(self, f, line: str, what: str) -> None:
        """One line to an open file of the run dir, flushed (a torn last line is dropped by ``cut_back``)."""
        with run_dir_writing(Path(f.name), what):
            f.write(line + "\n")
            f.flush()

    def _wandb_writing(self, what: str):
        return writing("hydra.run.dir", self.run_dir / "wandb", what,
                       RUN_DIR_FIX + " (or set logging.wandb.mode=disabled)")

    def _derive(self, cfg: dict, device: torch.device | None) -> None:
        """FLOPs per token, peak FLOP/s, and the simulated pipeline bubble (static per run)."""
        from models.config import ModelConfig
        try:
            self.flops = flops_per_token(ModelConfig(**cfg["model"]), cfg["data"]["seq_len"])
        except Exception as e:   # never stop training over a derived metric
            self.write(f"metrics: FLOPs per token unavailable ({e}); throughput/mfu omitted")
        self.peak, self.peak_src = peak_flops(device, (cfg.get("logging") or {}).get("peak_tflops"))
        if self.flops is not None:
            self.static["throughput/flops_per_token"] = self.flops.per_token
        if self.peak is not None:
            self.static["throughput/peak_tflops"] = self.peak / 1e12
        p, t = cfg["parallel"], cfg["train"]
        if p["pp"] > 1:
            dp = max(1, self.world_size // p["pp"])
            n_micro = micro_batches(t["global_batch_size"], t["micro_batch_size"], dp)
            schedule = p["schedule"]   # pp > 1 always names one (parallel.dims.validate_layout)
            try:
                self.static["pipeline/bubble_unit_costs"] = simulated_bubble(schedule, p["pp"], n_micro)
            except ValueError as e:
                self.write(f"metrics: no simulated bubble for {schedule} pp={p['pp']} with {n_micro} "
                           f"micro-batches: {e}")

    # ---- per step ------------------------------------------------------------------------------
    def derived(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Achieved TFLOP/s per rank and MFU for a step's metrics."""
        out = {}
        if self.flops is not None and metrics.get("tokens_per_s"):
            achieved = metrics["tokens_per_s"] * self.flops.per_token / self.world_size
            out["tflops_per_rank"] = achieved / 1e12
            if self.peak:
                out["mfu"] = achieved / self.peak
        return out

    def log_step(self, metrics: dict[str, Any], expert_load: list[torch.Tensor] | None = None) -> None:
        if not self.is_main:
            return
        row = metrics | self.derived(metrics)
        step = self._last_step = row["step"]
        self._append(self._files["metrics.jsonl"], json_line(row), f"the metrics of step {step}")
        self._track(row)
        loads = [x.detach().float().cpu() for x in (expert_load or [])]
        window = self._loads.add(step, loads)
        if window is not None:
            self._log_window(window, step)
        if self.wandb is not None:
            with self._wandb_writing(f"the W&B metrics of step {step}"):
                self.wandb.log_step(row, loads, self._step_tokens(row), window)
        if self.log_every and (step % self.log_every == 0 or step >= self.total_steps):
            self.write(self._plain_line(row))
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            post = {"loss": f"{row['loss']:.3f}", "tok/s": _human(row.get("tokens_per_s", 0.0))}
            if "mfu" in row:
                post["mfu"] = f"{100 * row['mfu']:.1f}%"
            self.bar.set_postfix(post, refresh=False)

    def _log_window(self, window: Window, step: int) -> None:
        from_step, rel_LE = window
        row = {"step": step, "from_step": from_step, "load_over_mean": [[round(v, 4) for v in layer]
                                                                       for layer in rel_LE.tolist()]}
        self._append(self._files["expert_load.jsonl"], json_line(row),
                     f"the expert loads of steps {from_step}-{step}")

    def _plain_line(self, row: dict) -> str:
        """``step 20/150 | loss 5.1234 | lr 2.9e-03 | grad norm 0.81 | 7.4k tok/s | MFU 31.2% | mem 0.50 GB | ETA 0:01:23``
        (with data.blend: ``| data web 50% code 30% math 20%``)"""
        step = row["step"]
        done = max(1, step - self._first_step)
        eta = int(self._totals["time"] / done * max(0, self.total_steps - step))
        parts = [f"step {step}/{self.total_steps}", f"loss {row['loss']:.4f}", f"lr {row.get('lr', float('nan')):.3g}",
                 f"grad norm {row.get('grad_norm', float('nan')):.3g}",
                 f"{_human(row.get('tokens_per_s', 0.0))} tok/s",
                 f"MFU {100 * row['mfu']:.1f}%" if "mfu" in row else "MFU n/a (set logging.peak_tflops)",
                 f"mem {row['mem_peak_gb']:.2f} GB" if "mem_peak_gb" in row else "mem n/a",
                 f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"]
        shares = {k.removeprefix("tokens/"): v for k, v in row.items() if k.startswith("tokens/")}
        if shares and sum(shares.values()) > 0:   # data.blend: each source's share of the tokens since start-up
            total = sum(shares.values())
            parts.append("data " + " ".join(f"{n} {100 * v / total:.0f}%" for n, v in shares.items()))
        if row.get("skipped"):
            parts.append("SKIPPED (non-finite)")
        return " | ".join(parts)

    def _step_tokens(self, row: dict) -> int:
        """Tokens of the step ``row`` logs (its own batch size under train.batch_ramp)."""
        return row["global_batch_size"] * self.seq_len if "global_batch_size" in row else self.step_tokens

    def _track(self, row: dict) -> None:
        self._totals["tokens"] += self._step_tokens(row)
        self._totals["time"] += row.get("step_time_s", 0.0)
        if "mem_peak_gb" in row and (self._totals["mem_peak_gb"] or 0) <= row["mem_peak_gb"]:
            self._totals["mem_peak_gb"], self._totals["mem_peak_rank"] = row["mem_peak_gb"], row.get("mem_peak_rank")

    # ---- eval, text, end -------------------------------------------------------------------------
    def log_eval(self, step: int, val_loss: float, per_source: dict[str, float] | None = None) -> None:
        """``per_source``: ``{"val_loss/<name>": loss}`` of each data.val_blend source."""
        if not self.is_main:
            return
        self._append(self._files["eval.jsonl"], json_line({"step": step, "val_loss": val_loss} | (per_source or {})),
                     f"the validation loss of step {step}")
        sources = ", ".join(f"{k.removeprefix('val_loss/')} {v:.4f}" for k, v in (per_source or {}).items())
        self.write(f"validation at step {step}/{self.total_steps}: val_loss {val_loss:.4f}"
                   + (f" ({sources})" if sources else ""))
        if self.wandb is not None:
            with self._wandb_writing(f"the W&B validation loss of step {step}"):
                self.wandb.log_eval(step, val_loss, per_source or {})

    def write(self, line: str) -> None:
        if not self.is_main:
            return
        if self._log is not None:
            self._append(self._log, line, "the run log")
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def summary(self) -> str:
        """Run-level throughput and memory for the final line: achieved TFLOP/s per rank, MFU, peak memory."""
        if not self.is_main:
            return ""
        parts, run = [], {}
        tot = self._totals
        if self.flops is not None and tot["time"] > 0:
            achieved = tot["tokens"] / tot["time"] * self.flops.per_token / self.world_size
            run["throughput/run_tflops_per_rank"] = achieved / 1e12
            text = f"{achieved / 1e12:.3g} TFLOP/s/rank"
            if self.peak:
                run["throughput/run_mfu"] = achieved / self.peak
                text += f" (MFU {100 * achieved / self.peak:.1f}%)"
            else:
                text += f" (MFU n/a: peak unknown, {self.peak_src})"
            parts.append(text)
        if tot["mem_peak_gb"] is not None:
            parts.append(f"peak mem {tot['mem_peak_gb']:.2f} GB (rank {tot['mem_peak_rank']})")
        if self.wandb is not None:
            self.wandb.update_summary(run)
        return "".join(f"; {p}" for p in parts)

    def close(self) -> None:
        window = self._loads.close(self._last_step)   # a run stopped between two (rank 0 only: others add none)
        if window is not None:
            self._log_window(window, self._last_step)
        if self.wandb is not None:   # first: it may still write a line to train.log
            with self._wandb_writing("the end of the W&B run"):
                self.wandb.close(self._last_step, self.write, window)
            self.wandb = None
        if self.bar is not None:
            self.bar.close()
        for f in (*self._files.values(), self._log):
            if f is not None:
                f.close()
        self._files = {}
