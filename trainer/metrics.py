"""Step metrics: ``metrics.jsonl`` in the run dir, Weights & Biases (offline by default), tqdm on rank 0.

W&B panels are grouped by the metric name's prefix (W&B makes one section per prefix):

  train/       loss, mtp_loss, aux_loss, lr, grad_norm, tokens, bias_update_speed, mtp_loss_weight
               (val/loss: validation)
  throughput/  tokens_per_s (global), step_time_s, tflops_per_rank (achieved model FLOP/s per rank),
               mfu (against the device's peak; omitted when the peak is unknown, e.g. on CPU)
  experts/     max_over_mean (worst layer), moe<i>_max_over_mean / moe<i>_min_over_mean per MoE layer,
               moe<i>_load (histogram: tokens per expert), load_heatmap (image: MoE layer x expert,
               load / mean over the steps since the previous heatmap)
  comm/        cross_node_tokens (token copies sent across a node boundary, summed over layers and
               ranks), cross_node_per_token (that / (tokens x MoE layers)), max_nodes_per_token,
               dispatch_s, combine_s (EP runs only)
  pipeline/    (pp > 1) bubble_measured (rank 0's idle share of its span, from the executor),
               bubble_simulated (the simulator on the same action lists with the step's measured costs),
               bubble_unit_costs (the schedule alone: largest bubble / makespan with F = b = W = 1, no
               overlap, no p2p latency; logged once, also in the summary)
  memory/      peak_gb_max / peak_gb_min / peak_rank over ranks, rank<r>_peak_gb (worlds <= 64):
               CUDA ``max_memory_allocated``, on CPU the process's peak RSS
               state_{params,grads,master,optim}_gb: the training state rank 0 holds (optimizer accounting,
               parallel/zero/memory.py; constant over a run)

FLOPs per token (training, forward + backward), the basis of MFU:
    6 * N + 3 * (L + D) * H * (d_qk + d_v) * T
N: parameters a token's matmuls touch, without the embedding (a lookup): the activated parameters
(``models.params``) minus the embedding, plus per MTP depth the MTP module with K of E routed experts
and another pass through the shared output head. The second term is causal attention: QK^T and AV
cost 2 * H * (d_qk + d_v) * c FLOPs forward for a query with c keys, c averages T/2, and backward is
twice forward; L layers, D MTP depths, T = data.seq_len.
MFU = tokens_per_s * FLOPs per token / (world size * peak FLOP/s per device). The peak is dense BF16
tensor-core FLOP/s from ``PEAK_FLOPS`` by device name, or ``$DSV3_PEAK_TFLOPS`` (TFLOP/s per device;
set it for a GPU not in the table, or to compare a CPU against a peak you choose).

``metrics.jsonl`` / ``eval.jsonl`` hold one strict-JSON line per step (non-finite numbers as ``null``). A run
that resumes from a checkpoint at step k first cuts both files back to step k, so the steps it redoes appear
once. The W&B run id is chosen once per run lineage (``$WANDB_RUN_ID``, else the id saved in the checkpoint
being resumed, else a new one), written into every checkpoint (``wandb_run_id.txt``) and passed to
``wandb.init(id=..., resume="allow")``: a resumed run continues the same W&B run. Offline, every start writes
its own ``offline-run-<time>-<id>`` dir with that id; ``wandb sync`` uploads them in order into one run.

Offline runs can be read back without network with ``trainer.wandb_log.read_offline_run`` (parses the ``.wandb``
transaction log with wandb's own protobuf records). ``close()`` returns only once W&B's service has written
the whole log: ``wandb.finish()`` does not wait for that (see ``_wait_for_transaction_log``).
"""
from __future__ import annotations

import json
import math
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .wandb_log import _wait_for_transaction_log

# Dense (no sparsity) BF16 tensor-core peak per device, FLOP/s. First substring match of the CUDA
# device name wins, so the more specific names come first.
PEAK_FLOPS: list[tuple[str, float]] = [
    ("GH200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("H200", 989e12),
    ("H20", 148e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
]
PER_RANK_LIMIT = 64   # log memory/rank<r>_peak_gb for worlds up to this size
RUN_ID_FILE = "wandb_run_id.txt"   # in every checkpoint dir: the W&B run id of the run that wrote it
WANDB_CLOSE_TIMEOUT_S = 120.0      # how long close() waits for W&B's service to write the run's log


# ---- derived quantities --------------------------------------------------------------------------
@dataclass(frozen=True)
class Flops:
    matmul_params: int     # N in 6N: parameters a token's matmuls touch (no embedding; MTP included)
    attention: float       # the attention term per token (forward + backward)

    @property
    def per_token(self) -> float:
        return 6 * self.matmul_params + self.attention


def flops_per_token(model_cfg, seq_len: int, model=None) -> Flops:
    """Training FLOPs per token of ``model_cfg`` (a ``ModelConfig``) at ``seq_len``; formula in the module doc.
    ``model``: the single-device model of that config if already built (any device, meta is enough)."""
    import models
    from models.moe import GroupedExperts
    from models.params import count_params

    model = model if model is not None else models.build(model_cfg, "meta")
    c = count_params(model)
    m = model_cfg
    mtp_routed = sum(p.numel() for name, mod in model.named_modules()
                     if name.startswith("mtp.") and isinstance(mod, GroupedExperts) for p in mod.parameters())
    mtp_activated = c.mtp - mtp_routed + mtp_routed * m.n_activated_experts // m.n_routed_experts
    n = c.activated - c.embedding + mtp_activated + m.mtp_depth * c.head
    attn = 3.0 * (m.n_layers + m.mtp_depth) * m.n_heads * (m.qk_head_dim + m.v_head_dim) * seq_len
    return Flops(n, attn)


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
    if key == "val_loss":
        return "val/loss"
    if key.startswith("val_loss/"):
        return "val/loss_" + key[9:]
    if key.startswith("tokens/"):
        return "data/tokens_" + key[7:]
    return f"train/{key}"


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
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
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
class MetricsLogger:
    """One per rank; only rank 0 (``is_main``) writes. ``config_dict`` is the full run config as a dict;
    ``device`` and ``world_size`` give MFU and per-rank numbers. ``heatmap_every``: steps between expert-load
    heatmaps (default ``total_steps // 20``; one is also drawn at the end).

    ``start_step``: the step the run starts from (the resumed checkpoint's); ``metrics.jsonl`` and
    ``eval.jsonl`` are first cut back to it. ``run_id``: the W&B run id saved in that checkpoint
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
        self.heatmap_every = heatmap_every or max(1, total_steps // 20)
        self.run_id = (os.environ.get("WANDB_RUN_ID") or run_id or new_run_id()) if is_main else None
        self._file = self._eval_file = self._log = None
        if is_main:
            self._log = open(self.run_dir / "train.log", "a")
            cut = {name: cut_back(self.run_dir / name, start_step) for name in ("metrics.jsonl", "eval.jsonl")}
            self._file = open(self.run_dir / "metrics.jsonl", "a")
            self._eval_file = open(self.run_dir / "eval.jsonl", "a")
        self.wandb = None
        self.bar = None
        self._load_sum: list[torch.Tensor] | None = None
        self._load_from = start_step + 1
        self._static_logged = False
        self._last_step = self._first_step = start_step
        self._totals = {"tokens": 0.0, "time": 0.0, "mem_peak_gb": None, "mem_peak_rank": None}
        if not is_main:
            return
        self.seq_len = config_dict["data"]["seq_len"]
        self.step_tokens = config_dict["train"]["global_batch_size"] * self.seq_len   # without a batch ramp
        self.flops, self.peak, self.peak_src, self.static = None, None, "", {}
        self._derive(config_dict, device)
        if any(cut.values()):
            self.write(f"metrics: starting at step {start_step}: dropped the lines after it ("
                       + ", ".join(f"{n} from {name}" for name, n in cut.items() if n) + "); those steps are redone")
        if wandb_cfg.mode != "disabled":
            self.wandb = self._init_wandb(wandb_cfg, config_dict)
        if progress and sys.stderr.isatty():   # a bar for terminals; log files get the plain lines
            from tqdm.auto import tqdm
            # ETA from the step rate; redraw rarely when stderr is a log file rather than a terminal.
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            mininterval=0.1 if sys.stderr.isatty() else 30.0)

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
            n_micro = t["global_batch_size"] // (t["micro_batch_size"] * dp)
            schedule = p["schedule"] if p["schedule"] != "none" else "1f1b"
            try:
                self.static["pipeline/bubble_unit_costs"] = simulated_bubble(schedule, p["pp"], n_micro)
            except ValueError as e:
                self.write(f"metrics: no simulated bubble for {schedule} pp={p['pp']} with {n_micro} "
                           f"micro-batches: {e}")

    def _init_wandb(self, wandb_cfg, config_dict: dict):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb
        mode = wandb_cfg.mode
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or _netrc_has_wandb()):
            self.write("logging.wandb.mode=online but neither WANDB_API_KEY nor a `wandb login` was found: logging "
                       f"offline to {self.run_dir / 'wandb'} (upload later with `wandb sync`)")
            mode = "offline"
        # One W&B run per run lineage: a resumed run continues it (online; offline, see the module doc).
        run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, name=wandb_cfg.name or
                         run_name(config_dict, self.world_size),
                         tags=list(wandb_cfg.tags), mode=mode, dir=str(self.run_dir), config=config_dict,
                         id=self.run_id, resume="allow")
        run.summary.update(dict(self.static) |
                           {"throughput/flops_formula": "6*N + 3*(L+D)*H*(d_qk+d_v)*T",
                            "throughput/peak_source": self.peak_src})
        return run

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
        self._file.write(json_line(row) + "\n")
        self._file.flush()
        self._track(row)
        loads = [x.detach().float().cpu() for x in (expert_load or [])]
        if self.wandb is not None:
            self.wandb.log(self._wandb_row(row, loads), step=step)
        if self.log_every and (step % self.log_every == 0 or step >= self.total_steps):
            self.write(self._plain_line(row))
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            post = {"loss": f"{row['loss']:.3f}", "tok/s": _human(row.get("tokens_per_s", 0.0))}
            if "mfu" in row:
                post["mfu"] = f"{100 * row['mfu']:.1f}%"
            self.bar.set_postfix(post, refresh=False)

    def _plain_line(self, row: dict) -> str:
        """``step 20/150 | loss 5.1234 | lr 2.9e-03 | grad norm 0.81 | 7.4k tok/s | MFU 31.2% | mem 0.50 GB | ETA 0:01:23``"""
        step = row["step"]
        done = max(1, step - self._first_step)
        eta = int(self._totals["time"] / done * max(0, self.total_steps - step))
        parts = [f"step {step}/{self.total_steps}", f"loss {row['loss']:.4f}", f"lr {row.get('lr', float('nan')):.3g}",
                 f"grad norm {row.get('grad_norm', float('nan')):.3g}",
                 f"{_human(row.get('tokens_per_s', 0.0))} tok/s",
                 f"MFU {100 * row['mfu']:.1f}%" if "mfu" in row else "MFU n/a (set logging.peak_tflops)",
                 f"mem {row['mem_peak_gb']:.2f} GB" if "mem_peak_gb" in row else "mem n/a",
                 f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"]
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

    def _wandb_row(self, row: dict, loads: list[torch.Tensor]) -> dict:
        out = {}
        for k, v in row.items():
            if k == "step" or k == "mem_peak_gb_per_rank":
                continue
            out[panel_name(k)] = v
        for r, gb in enumerate(row.get("mem_peak_gb_per_rank", [])):
            out[f"memory/rank{r}_peak_gb"] = gb
        if "ep_cross_node_tokens" in row and loads:
            out["comm/cross_node_per_token"] = row["ep_cross_node_tokens"] / (self._step_tokens(row) * len(loads))
        if not self._static_logged:   # once, so that the value gets a panel (it is in the summary too)
            out |= {k: v for k, v in self.static.items() if k.startswith("pipeline/")}
            self._static_logged = True
        for i, load in enumerate(loads):
            mean = load.mean().clamp_min(1e-9)
            out[f"experts/moe{i}_max_over_mean"] = float(load.max() / mean)
            out[f"experts/moe{i}_min_over_mean"] = float(load.min() / mean)
            out[f"experts/moe{i}_load"] = self._wandb_hist(load)
        if loads:
            self._load_sum = loads if self._load_sum is None else [a + b for a, b in zip(self._load_sum, loads)]
            if row["step"] % self.heatmap_every == 0 or row["step"] >= self.total_steps:
                out["experts/load_heatmap"] = self._heatmap(row["step"])
        return out

    def _heatmap(self, step: int):
        import wandb
        img = expert_load_heatmap(self._load_sum, f"expert load / layer mean, steps {self._load_from}-{step}")
        self._load_sum, self._load_from = None, step + 1
        return wandb.Image(img)

    # ---- eval, text, end -------------------------------------------------------------------------
    def log_eval(self, step: int, val_loss: float, per_source: dict[str, float] | None = None) -> None:
        """``per_source``: ``{"val_loss/<name>": loss}`` of each data.val_blend source."""
        if not self.is_main:
            return
        self._eval_file.write(json_line({"step": step, "val_loss": val_loss} | (per_source or {})) + "\n")
        self._eval_file.flush()
        if self.wandb is not None:
            self.wandb.log({"val/loss": val_loss} | {panel_name(k): v for k, v in (per_source or {}).items()},
                           step=step)

    def write(self, line: str) -> None:
        if not self.is_main:
            return
        if self._log is not None:
            self._log.write(line + "\n")
            self._log.flush()
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
            self.wandb.summary.update(run)
        return "".join(f"; {p}" for p in parts)

    def close(self) -> None:
        if self.wandb is not None and self._load_sum is not None:   # stopped between heatmaps (stop_at_step)
            self.wandb.log({"experts/load_heatmap": self._heatmap(self._last_step)}, step=self._last_step)
        if self.bar is not None:
            self.bar.close()
        for f in (self._file, self._eval_file, self._log):
            if f is not None:
                f.close()
        if self.wandb is not None:
            log = Path(self.wandb.settings.sync_file)
            self.wandb.finish()
            self.wandb = None
            if not _wait_for_transaction_log(log, WANDB_CLOSE_TIMEOUT_S):
                self.write(f"metrics: W&B's service had not finished writing {log} after "
                           f"{WANDB_CLOSE_TIMEOUT_S:.0f}s; the offline run may lack its last records")

    @staticmethod
    def _wandb_hist(load: torch.Tensor):
        import wandb
        # One bar per expert: tokens routed to expert i.
        return wandb.Histogram(np_histogram=(load.numpy(), list(range(len(load) + 1))))


def expert_load_heatmap(loads: list[torch.Tensor], title: str):
    """RGB image (numpy uint8 [H, W, 3]) of load / layer mean: one row per MoE layer, one column per expert."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rel = torch.stack([x / x.mean().clamp_min(1e-9) for x in loads]).numpy()
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
