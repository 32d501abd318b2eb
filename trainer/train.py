"""The training loop: one process, one device. Reads as verbs: train_step, evaluate, log, save."""
from __future__ import annotations

import contextlib
import re
import time
import warnings
from pathlib import Path

import torch

from checkpoint import CheckpointManager
from configs.schema import Config
from data import BlendedBatches, batch_size_at, tokenizer_files, use_offline_hub
from parallel.collective_trace import CollectiveTrace, group_labels, step_from_env
from parallel.cuda_graph import CudaGraphs, GraphedStep, enabled as cuda_graph_enabled
from parallel.data_parallel import all_reduce_mean, all_reduce_sum_
from parallel.dims import ParallelDims
from parallel.fp8 import reuse_fp8_weights
from parallel.precision import Precision
from parallel.zero import NonFiniteGradients, build_optimizer

from . import run_state
from .ema import ParamEMA
from .health import HealthGuard
from .lifecycle import StopRequests, TrainingError, failure_cause, is_comm_failure
from .lr_schedule import lr_multiplier
from .metrics import StragglerWatch, rank_memory, run_dir_writing
from .owner import Owner
from .startup import (barrier, build_model, check_init_tokenizer, load_corpus_rank0_first, open_data, open_logger,
                      preflight_all_ranks, run_tokenizer)
from .timers import StepTimers


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)



def scheduler_step(scheduler) -> None:
    """``scheduler.step()``, without torch's warning that it ran before the optimizer's: that check looks for a
    call of the torch optimizer's own ``step``, and the AdamW kernel and the BF16-moment update (``parallel/zero``)
    update the weights without one, before this."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`"),
                                UserWarning)
        scheduler.step()

class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, dims: ParallelDims | None = None,
                 device: torch.device | None = None):
        use_offline_hub()   # data.blend never calls load_corpus; an init_from HF directory is read offline too
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        with run_dir_writing(self.run_dir, "the run directory"):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dims = dims or ParallelDims(world_size=1)
        # One owner per directory (trainer/owner.py): the run directory before anything is read or written there,
        # a checkpoint.dir outside it once it is known to be writable (_start).
        self.owners = [Owner(self.run_dir)]
        self.owners[0].acquire(self.dims)
        try:
            self._start(cfg, device)
        except BaseException:
            self.release()
            raise

    def _start(self, cfg: Config, device: torch.device | None) -> None:
        """Everything after the directories are this run's: the checkpoint to resume, the pre-flight check, data,
        model, optimizer, resume."""
        t = cfg.train
        self.device = device or pick_device(t.device)
        self.timers = StepTimers(self.device)   # time_<phase>_s per step (trainer/timers.py)
        self.precision = Precision(t.precision)
        self.autocast = torch.autocast(self.device.type, dtype=self.precision.autocast or torch.bfloat16,
                                       enabled=self.precision.autocast is not None)
        self.ckpt = self._open_checkpoints(cfg)
        self._resume_path = self.ckpt.resolve(cfg.checkpoint.resume)   # verified; damaged ones skipped (auto) or refused
        # Keys that cannot change within a run (the model, the seed, the token stream) refused now, the others listed
        self.config_changes = run_state.config_changes(cfg, self._resume_path) if self._resume_path else None
        # Before anything big is built: the estimate vs free memory (trainer/memory_plan.py).
        self.memory_note = preflight_all_ranks(cfg, self.dims, self.device) if t.memory_check else ""
        self.step, self.tokens = 0, 0   # the LR and batch-size schedules read both
        if cfg.checkpoint.init_from is not None and self._resume_path is None:
            check_init_tokenizer(cfg)   # before the corpus is tokenized: the data's ids mean the weights' tokens
        self.corpus = None if cfg.data.blend else load_corpus_rank0_first(cfg, self.dims)
        # The tokenizer's files (bos / eos / pad, special tokens, chat template): in the run dir and every checkpoint
        self.tokenizer_files = tokenizer_files(tok) if self.dims.is_main and (tok := run_tokenizer(cfg, self.corpus)) \
            else {}
        self.beat()
        # Every rank builds the full single-device model from the same seed, then keeps its expert shard. Starting
        # from HF weights, it builds on meta instead and materialises only what it keeps (its stages, its experts'
        # slice) before reading those tensors: host memory about its own shard (models.hf.load_hf_into).
        init = cfg.checkpoint.init_from
        hf_init = init is not None and self._resume_path is None and (Path(init).expanduser() / "config.json").is_file()
        self.model, self.pipe = build_model(cfg, self.dims, self.device, on_meta=hf_init)
        self.beat()
        # Start-up lines for the log (written once the logger exists). init_from comes before the optimizer:
        # it takes its FP32 master (ZeRO: its pieces) from the weights, which are FP32 until then.
        self.notes: list[str] = [] if init is None else [run_state.apply_init_from(self)]
        # zero=0: torch AdamW + all-reduce; zero=1/2: sharded (parallel/zero); same calls either way. With
        # precision bf16/fp8 it keeps the FP32 values as its master and casts the weights to BF16.
        self.opt = build_optimizer(self.model, cfg.optim, self.dims, cfg.parallel.zero, cfg.parallel.zero_backend,
                                   cfg.parallel.zero_bucket_mb, self.pipe.grad_weight if self.pipe else None,
                                   weights=self.precision.weights)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt.optimizer, self._lr_multiplier)
        self.graphed = self._graphed_step()
        master = self.opt.master_weights()   # the FP32 truth of BF16 weights (None: the FP32 weights are)
        halves = getattr(self.opt, "master_halves", lambda: None)()   # a split master's live halves (zero=0 only)
        self.ema = ParamEMA(halves or (self.model if master is None else master), t.ema_decay) if t.ema_decay else None
        self.memory = self.opt.memory()   # bytes of weights, gradients, master, optimizer state on this rank
        self.batches, self.val, self.val_sources = open_data(cfg, self.dims, self.corpus)   # per data.val_blend source
        m = cfg.model
        self.health = HealthGuard(t.health, m.vocab_size, m.n_routed_experts / m.n_activated_experts
                                  if m.first_k_dense < m.n_layers else None) if t.health.enabled else None
        self.ckpt.remove_partial()
        barrier(self.dims)
        self.resumed_from = self.maybe_resume()
        self.stops = StopRequests(self.dims.rank)   # installed by train(), for the whole loop
        self.stop_requested = False
        self.save_failed = False   # a background save (checkpoint.async_save) failed on some rank: agreed per step
        self.skipped_in_a_row = 0
        self._saved_step, self._saved_path = None, None
        self._busy_s, self._rank_busy, self._comm_s = 0.0, None, 0.0   # this rank's compute seconds of the last step; every rank's
        self.stragglers = StragglerWatch(cfg.logging)

    def _open_checkpoints(self, cfg: Config) -> CheckpointManager:
        """The run's ``CheckpointManager``; an unwritable ``checkpoint.dir`` fails now, not at the first save."""
        ckpt = CheckpointManager(cfg.checkpoint.dir or self.run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                 is_writer=self.dims.is_main, background=cfg.checkpoint.async_save,
                                 timeout_s=cfg.parallel.timeout_s)
        if cfg.checkpoint.every or cfg.checkpoint.save_final:
            ckpt.check_writable()
            if not ckpt.root.resolve().is_relative_to(self.run_dir.resolve()):
                self.owners.append(Owner(ckpt.root, "checkpoint.dir"))
                self.owners[-1].acquire(self.dims)
        return ckpt

    def beat(self) -> None:
        """The heartbeat of this run's directory locks (trainer/owner.py)."""
        for o in self.owners:
            o.beat()

    def release(self) -> None:
        """Give up this run's directory locks (at the end of ``train``, or when start-up fails)."""
        for o in self.owners:
            o.release()

    def _lr_multiplier(self, scheduler_step: int) -> float:
        """LambdaLR's factor for its step ``scheduler_step``, after ``self.tokens`` consumed tokens."""
        return lr_multiplier(self.cfg.optim, self.cfg.train.max_steps, scheduler_step, self.tokens)

    # ---- state (trainer/run_state.py) ------------------------------------------------------------
    def state_dict(self) -> dict:
        return run_state.state_dict(self)

    def maybe_resume(self) -> Path | None:
        """Resume from the checkpoint chosen and verified at start-up (CheckpointManager.resolve), if any."""
        if self._resume_path is not None:
            run_state.resume(self, self._resume_path)
        return self._resume_path

    def save(self, background: bool = False) -> Path:
        """Save the current step; ``background``: stage it and write it in the background (``save_async``)."""
        files = run_state.checkpoint_files(self)
        return (self.ckpt.save_async if background else self.ckpt.save)(self.step, self.state_dict(), files)

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        """Train to ``train.max_steps`` (or a stop request); the directory locks are released at the end, however
        it ends."""
        # SIGTERM / SIGINT / SIGUSR1 from the loop's first line (opening W&B, the first validation) to its last (the
        # logger closed): noted, acted on at the next step boundary (checkpoint, exit 75), never cutting a close short
        self.stops.install()
        try:
            return self._train()
        finally:
            self.stops.restore()
            self.release()

    def _train(self) -> dict:
        t = self.cfg.train
        self.logger = open_logger(self)
        end_step = min(t.max_steps, t.stop_at_step or t.max_steps)
        if self.step >= end_step:
            self.logger.write(f"nothing to do: already at train.max_steps={t.max_steps}" if self.step >= t.max_steps else
                              f"nothing to do: already at train.stop_at_step={t.stop_at_step}"
                              + f" (checkpoint {self.resumed_from}); raise it to train further")
            self.logger.close()
            return {"val_loss_start": None, "val_loss_end": None, "last": {}}
        summary = {"val_loss_start": None, "val_loss_end": None}
        if not self.val:   # data.val_fraction=0 (data/corpus.py), or data.blend without data.val_blend
            self.logger.write("validation off: " + ("data.val_blend is empty" if self.cfg.data.blend else
                              "data.val_fraction=0 holds out no documents") + ", so no val_loss is computed")
        if self.step == 0 and self.val:
            summary["val_loss_start"] = self.validate(0)
        start, start_step, start_tokens = time.perf_counter(), self.step, self.tokens
        trace_step = step_from_env()
        metrics = self._run_steps(end_step, trace_step, summary)
        if self.cfg.checkpoint.save_final and self.step > start_step and "stopped" not in summary:
            self._save_once()   # a stop request now changes nothing: this save is the last one anyway
        self._saved_in_background()   # the last periodic save, if save_final did not wait for it
        self._finish(summary, metrics, time.perf_counter() - start, self.tokens - start_tokens)
        return summary | {"last": metrics}

    def _run_steps(self, end_step: int, trace_step: int | None, summary: dict) -> dict:
        """Steps until ``end_step`` or a stop request, validating, logging and saving on the way; returns the
        last step's metrics and records val_loss_end (and "stopped") in ``summary``."""
        t = self.cfg.train
        metrics = {}
        while self.step < end_step:
            metrics = self.traced_step() if trace_step == self.step + 1 else self.train_step()
            self.beat()
            if self.save_failed:   # every rank agreed on it in this step's check: each waits for its own end of it
                self._saved_in_background()   # raises
            self._log_saved(self.ckpt.poll())
            if self.check_health(metrics):   # rolled back: this step's timeline is abandoned
                continue
            if self.stop_requested:   # every rank agreed on it in this step's check
                self.logger.log_step(metrics, self._last_load)
                path = self._save_once()
                self.logger.write(f"stopping at step {self.step} on request ({self.stops.signal or 'a peer'}): "
                                  f"checkpoint {path}; resume with checkpoint.resume=auto")
                summary["stopped"] = self.stops.signal or "peer"
                break
            if self.val and ((t.eval_every and self.step % t.eval_every == 0) or self.step == end_step):
                metrics["val_loss"] = summary["val_loss_end"] = self.validate(self.step)
            self.logger.log_step(metrics, self._last_load)
            if self.skipped_in_a_row >= t.max_skipped_steps:
                raise TrainingError(
                    f"step {self.step}: {self.skipped_in_a_row} steps in a row had a non-finite loss or gradients "
                    f"({self._nonfinite_where}; train.max_skipped_steps={t.max_skipped_steps}). The weights are "
                    f"those of step {self.step - self.skipped_in_a_row}; lower optim.lr, check the data, or resume "
                    f"from an earlier checkpoint (checkpoint.resume=<step dir>)")
            every = self.cfg.checkpoint.every
            if every and self.step % every == 0:
                self._save_once(background=self.cfg.checkpoint.async_save)
        return metrics

    def _finish(self, summary: dict, metrics: dict, elapsed: float, tok: int) -> None:
        """The run's last log line (``tok`` tokens in ``elapsed`` seconds): ``done: ...``, or for a run stopped on
        request ``stopped at step N (checkpoint ...): resume with ...``; waits for the EMA; closes the logger."""
        head = f"done: step {self.step}/{self.cfg.train.max_steps}, " if "stopped" not in summary else \
            (f"stopped at step {self.step}/{self.cfg.train.max_steps} (checkpoint {self._saved_path}): resume with "
             "checkpoint.resume=auto; ")
        self.logger.write(
            f"{head}{tok} tokens in {elapsed:.1f}s "
            f"({tok / max(elapsed, 1e-9):.0f} tok/s); loss {metrics.get('loss', float('nan')):.4f}; val_loss "
            f"{_fmt(summary['val_loss_start'])} -> {_fmt(summary['val_loss_end'])}{self.logger.summary()}; "
            f"run dir {self.run_dir}")
        if self.ema is not None:
            self.ema.wait()
        self.logger.close()

    def _save_once(self, background: bool = False) -> Path:
        """Save the current step unless it is already saved, after the save in the background (if any) is done.
        ``background`` (checkpoint.async_save, periodic saves): stage the state and write it in the background."""
        if self._saved_step != self.step:
            self._saved_in_background()
            with self.phase("checkpoint save", step=self.step):
                t0 = time.perf_counter()
                self._saved_path, self._saved_step = self.save(background), self.step
            took = f"{time.perf_counter() - t0:.1f} s"
            self.logger.write(f"checkpoint staged: {self._saved_path} (step {self.step}, {took}; written in the "
                              f"background)" if background else
                              f"checkpoint saved: {self._saved_path} (step {self.step}, {took})")
        return self._saved_path

    def check_health(self, metrics: dict) -> bool:
        """The health guard's verdict on a finite step (trainer/health.py), in ``metrics`` and the log; after
        ``train.health.patience`` unhealthy steps in a row, logs the step and rolls back (returns True)."""
        if self.health is None or metrics.get("skipped"):
            return False
        why = self.health.check(metrics)
        metrics |= {"unhealthy": why is not None, "rollbacks": self.health.rollbacks}
        if why is None:
            return False
        h = self.cfg.train.health
        self.logger.write(f"step {self.step}: unhealthy: {why} ({self.health.streak} in a row; a rollback at "
                          f"train.health.patience={h.patience})")
        if self.health.streak < h.patience:
            return False
        self.logger.log_step(metrics, self._last_load)
        self.roll_back()
        return True

    def roll_back(self) -> None:
        """Back to the newest checkpoint written while healthy, keeping the data position: the data read since
        is skipped. The target is saved again at once with that position and the guard's record, so a resume
        skips the same data. Stops the run (exit 3) after ``train.health.max_rollbacks`` or without a target."""
        h, g, bad = self.cfg.train.health, self.health, self.step
        self._saved_in_background()   # complete (it may be the target) before the checkpoints are looked at
        with self.phase("rollback: finding a healthy checkpoint", step=bad):
            target = self.ckpt.newest_healthy(before_step=bad)
        if g.rollbacks >= h.max_rollbacks:
            where = f"checkpoint.resume={target}" if target else "none is left; start afresh"
            raise TrainingError(
                f"step {bad}: training is unhealthy again after {g.rollbacks} rollback(s) (train.health."
                f"max_rollbacks={h.max_rollbacks}; skipped the data of steps {_windows(g.skipped)}); lower optim.lr "
                f"or check the data, and resume from the newest checkpoint written while healthy ({where})")
        if target is None:
            raise TrainingError(
                f"step {bad}: training is unhealthy ({g.streak} steps in a row) and no checkpoint written while "
                f"healthy is left in {self.ckpt.root} to roll back to (checkpoint.every="
                f"{self.cfg.checkpoint.every}); lower optim.lr or check the data, and save more often")
        position, record = self.batches.state_dict(), (g.rollbacks + 1, g.skipped)
        if self.ema is not None:
            self.ema.wait()   # its background fold must not race the load
        with self.phase("rollback: loading the checkpoint", step=bad):
            run_state.resume(self, target)
        self.batches.load_state_dict(position)   # the data of the abandoned steps is not read again
        g.streak, g.rollbacks, g.skipped = 0, record[0], record[1] + [[self.step + 1, bad]]
        self.opt.zero_grad()
        self.logger.rewind(self.step)
        self.logger.write(f"step {bad}: rolled back to step {self.step} ({target}), skipping the data of steps "
                          f"{self.step + 1}-{bad}; rollback {g.rollbacks} of at most {h.max_rollbacks}")
        self._saved_step = None
        self._save_once()   # the target again, with the new data position and the guard's record

    def _saved_in_background(self) -> None:
        """Wait for the save in the background (checkpoint.async_save), if any, and log it. Every rank calls it at
        the same step; its failure raises what a synchronous save's would (``CheckpointWriteError``: exit 2)."""
        if not self.ckpt.in_flight():
            return
        with self.phase("checkpoint save in the background", step=self._saved_step):
            done = self.ckpt.wait()
        self._log_saved(done)

    def _log_saved(self, done: tuple[int, Path, float] | None) -> None:
        if done is not None:
            step, path, seconds = done
            self.logger.write(f"checkpoint saved: {path} (step {step}, {seconds:.1f} s in the background)")

    def check_step(self, sums: torch.Tensor) -> list[int]:
        """One reduction per step, before the update: the ranks whose loss or gradients hold inf/nan,
        (``self.stop_requested``) whether any rank was asked to stop, (``self.save_failed``) whether any rank's
        background save failed, and (``self._rank_busy``) every rank's compute seconds of the previous step
        (straggler metrics)."""
        w = self.dims.world_size
        flags = torch.zeros(2 * w + 2 if w > 1 else w + 2, dtype=torch.float64, device=self.device)
        flags[self.dims.rank] = (~(torch.isfinite(sums).all() & self.opt.grads_finite())).double()
        flags[w] = float(self.stops.signal is not None)
        flags[w + 1] = float(self.ckpt.failed())
        if w > 1:
            flags[w + 2 + self.dims.rank] = self._busy_s
            with self.phase("non-finite / stop check (world all-reduce)"):
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        flags = flags.tolist()
        self.stop_requested = self.stop_requested or flags[w] > 0
        self.save_failed = flags[w + 1] > 0
        self._rank_busy = flags[w + 2:] if w > 1 and self._busy_s > 0 else None
        return [r for r in range(w) if flags[r] > 0]

    def skip_step(self, bad_ranks: list[int], sums: torch.Tensor, n_micro: int, gbs: int, t0: float) -> dict:
        """A step whose loss or gradients were non-finite somewhere: no update, no LR step, no bias update
        (its expert loads are dropped); the batch counts as consumed. Stops the run after
        ``train.max_skipped_steps`` in a row."""
        t = self.cfg.train
        self.opt.zero_grad()
        for moe in self.model.moe_layers():
            moe.tokens_per_expert.zero_()
        self._last_load = []
        self.skipped_in_a_row += 1
        self.step += 1
        step_tokens = gbs * self.cfg.data.seq_len
        self.tokens += step_tokens
        limit = t.max_skipped_steps   # train() stops the run there, after logging this step
        where = f"rank{'s' if len(bad_ranks) > 1 else ''} {', '.join(map(str, bad_ranks))}" if bad_ranks else \
            "the optimizer's gradient norm"
        self.logger.write(f"step {self.step}: non-finite loss or gradients ({where}): update skipped "
                          f"({self.skipped_in_a_row} in a row; the run stops at {limit})")
        self._nonfinite_where = where
        with self.phase("metric reductions", step=self.step):
            lm, mtp, aux = all_reduce_mean(sums / n_micro, self.dims).tolist()
            ep = self._ep_metrics()
        dt = time.perf_counter() - t0
        return {"step": self.step, "loss": lm, "mtp_loss": mtp, "aux_loss": aux, "skipped": True,
                "nonfinite_ranks": bad_ranks, "lr": self.scheduler.get_last_lr()[0], "grad_norm": float("nan"),
                "tokens": self.tokens, "global_batch_size": gbs, "step_time_s": dt, "tokens_per_s": step_tokens / dt,
                **ep, **self._source_metrics()}

    @contextlib.contextmanager
    def phase(self, what: str, step: int | None = None):
        """A communication failure inside (a peer that hung or died) ends the run as one line naming this
        rank, the step (default: the one in progress) and the phase, after what the lower layers named
        (``parallel/errors.py``)."""
        try:
            with self.timers(what):
                yield
        except TrainingError:
            raise
        except RuntimeError as e:
            if not is_comm_failure(e):
                raise
            raise TrainingError(f"rank {self.dims.rank}: step {self.step + 1 if step is None else step}, {what}: {str(e).splitlines()[0]} "
                                f"({failure_cause(e)}: a peer hung or died; see its own log; parallel.timeout_s="
                                f"{self.cfg.parallel.timeout_s})") from e

    def train_step(self) -> dict:
        t = self.cfg.train
        t0 = time.perf_counter()
        self.timers.reset()
        mtp_w = t.mtp_loss_weight.at(self.step, self.tokens)
        gamma = t.bias_update_speed.at(self.step, self.tokens)
        gbs = batch_size_at(t, self.tokens)   # train.batch_ramp, else train.global_batch_size
        input_ids, labels = map(self._to_device, self.batches.next_batch(gbs))   # this dp rank's share
        n_micro = len(input_ids.split(t.micro_batch_size))
        with self.phase("forward/backward"):
            if self.pipe is not None:
                micro = list(zip(input_ids.split(t.micro_batch_size), labels.split(t.micro_batch_size)))
                self.pipe.set_microbatches(n_micro)
                with self.autocast, reuse_fp8_weights(self.model):   # FP8: weights quantised once
                    sums = self.pipe.forward_backward(micro, 1.0 / n_micro, mtp_w, t.aux_loss_alpha)[:3].float()
                self.pipe.replicas.sum_(self.opt.named_grads())   # twin stages, tied embedding (FP32)
            elif self.graphed is not None:   # train.cuda_graph: replayed (parallel/cuda_graph.py)
                sums = self.graphed((input_ids, labels), (mtp_w,))
            else:
                sums = self.forward_backward(input_ids, labels, mtp_w)
        with self.phase("gradient reduction"):
            bad_ranks = self.check_step(sums)
        if bad_ranks:
            return self.skip_step(bad_ranks, sums, n_micro, gbs, t0)
        lr = self.scheduler.get_last_lr()[0]
        try:
            with self.phase("gradient reduction and optimizer step"):
                grad_norm = self.opt.step(self.cfg.optim.grad_clip)   # reduce over dp, clip, update (sharded with ZeRO)
        except NonFiniteGradients:
            return self.skip_step([], sums, n_micro, gbs, t0)
        self.skipped_in_a_row = 0
        if self.ema is not None:
            self.ema.update()   # copies the weights, then folds them in on a background thread
        self.opt.zero_grad()
        with self.phase("expert-load all-reduce"):
            self._last_load = self.update_expert_bias(gamma)
        self.step += 1
        step_tokens = gbs * self.cfg.data.seq_len
        self.tokens += step_tokens
        scheduler_step(self.scheduler)   # the next step's LR: after self.tokens moved (optim.decay=phases reads it)
        # The step's numbers reach the host in one sync (on CUDA: after the step's work is done, so the
        # step time below covers the GPU's work, not only the launches).
        with self.phase("metric reductions", step=self.step):
            scalars = [all_reduce_mean(sums / n_micro, self.dims).double(),
                       torch.as_tensor(grad_norm, dtype=torch.float64, device=self.device).reshape(1)]
            if self._last_load:
                loads = torch.stack(self._last_load).double()
                scalars.append((loads.amax(1) / loads.mean(1).clamp_min(1e-9)).amax().reshape(1))
            lm, mtp, aux, grad_norm, *imbalance = torch.cat(scalars).tolist()   # the host sync
            dt = time.perf_counter() - t0
            return {"step": self.step, "loss": lm, "mtp_loss": mtp, "aux_loss": aux, "lr": lr,
                    "grad_norm": grad_norm, "tokens": self.tokens, "global_batch_size": gbs, "step_time_s": dt,
                    "tokens_per_s": step_tokens / dt, "bias_update_speed": gamma, "mtp_loss_weight": mtp_w,
                    "max_expert_load_over_mean": imbalance[0] if imbalance else 1.0, **self._after_step_metrics()}

    def _graphed_step(self) -> GraphedStep | None:
        """``train.cuda_graph`` (``parallel.cuda_graph.enabled``, else None): ``forward_backward`` from a CUDA graph,
        under an autocast without its cache of cast weights (a capture's cache would be read at replays)."""
        t = self.cfg.train
        if not cuda_graph_enabled(t.cuda_graph, self.device, self.dims.world_size, self.precision.weights, t.recompute):
            return None
        autocast = torch.autocast(self.device.type, dtype=self.precision.autocast or torch.bfloat16,
                                  enabled=self.precision.autocast is not None, cache_enabled=False)
        return GraphedStep(lambda ids, labels, mtp_w: self.forward_backward(ids, labels, mtp_w, autocast),
                           self.model, self.opt, CudaGraphs(self.device))

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, mtp_w: float,
                         autocast: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
        """The step's micro-batches, forward and backward, without a pipeline; the summed (lm, mtp, aux) losses
        on the device (no host sync per micro-batch)."""
        t = self.cfg.train
        micro = list(zip(input_ids.split(t.micro_batch_size), labels.split(t.micro_batch_size)))
        sums = torch.zeros(3, device=input_ids.device)
        with reuse_fp8_weights(self.model):   # FP8: weights quantised once
            for ids, lab in micro:
                with autocast or self.autocast:
                    out = self.model.compute_loss(ids, lab, mtp_weight=mtp_w, aux_alpha=t.aux_loss_alpha)
                self.opt.backward(out.loss / len(micro))
                sums += torch.stack([out.lm_loss, out.mtp_loss, out.aux_loss]).float()
        return sums

    def _after_step_metrics(self) -> dict:
        """A finished step's counters after its host sync: EP traffic, phase times (and this rank's compute
        seconds for the next step's straggler check), pipeline, stragglers, memory, data sources."""
        ep, phases, pipeline = self._ep_metrics(), self.timers.read(), self._pipeline_metrics()
        self._busy_s = self._compute_seconds(phases)
        slow = self.stragglers.metrics(self._rank_busy, self.step, lambda line: self.logger.write(line))
        return {**ep, **phases, **pipeline, **slow, **rank_memory(self.device, self.dims),
                **{f"mem_state_{k}_gb": v / 1e9 for k, v in self.memory.measured.items()}, **self._source_metrics()}

    def _compute_seconds(self, phases: dict) -> float:
        """This rank's compute in the step just done: its pipeline compute actions, else its forward/backward less
        the time it waited in expert all-to-alls (a straggler's peers wait there for it)."""
        if self.pipe is not None:
            return sum(v for k, v in self.pipe.action_times().items() if k != "span")
        return max(phases.get("time_forward_backward_s", 0.0) - self._comm_s, 0.0)

    def _source_metrics(self) -> dict:
        """data.blend: tokens consumed per source since start-up (all ranks; the sample order is global)."""
        return self.batches.source_metrics() if isinstance(self.batches, BlendedBatches) else {}

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host batch -> device; on CUDA through pinned memory, so the copy runs asynchronously."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def traced_step(self) -> dict:
        """``train_step`` under the collective-order trace (``DSV3_TRACE_COLLECTIVES``,
        ``parallel/collective_trace.py``): fails at the first group whose ranks issued different collectives."""
        if self.dims.world_size == 1:
            return self.train_step()
        extra = {"replicas": self.pipe.replicas.groups} if self.pipe is not None else None
        with CollectiveTrace(group_labels(self.dims, extra), self.run_dir / "collective_trace") as trace:
            metrics = self.train_step()
        self.logger.write(f"step {self.step}: {trace.check()}")
        return metrics

    def _pipeline_metrics(self) -> dict:
        """This rank's (rank 0's, in the log) measured bubble share, the simulator's prediction, and its time
        in each kind of compute action (``pipeline_<kind>_s``; what ``tools.plan`` predicts per action kind)."""
        if self.pipe is None:
            return {}
        measured, simulated = self.pipe.bubble()
        times = {f"pipeline_{k}_s": v for k, v in self.pipe.action_times().items()}
        return {"pipeline_bubble_measured": measured, "pipeline_bubble_simulated": simulated, **times}

    def _ep_metrics(self) -> dict:
        """Dispatcher counters of this step over all MoE layers (summed/maxed over ranks), then reset."""
        stats = [m.dispatcher.stats for m in self.model.moe_layers() if hasattr(m.dispatcher, "stats")]
        self._comm_s = sum(s.dispatch_s + s.combine_s for s in stats)   # this rank's own waits
        if not stats:
            return {}
        dev = self.device   # NCCL reduces device tensors only
        v = torch.tensor([sum(s.cross_node_copies for s in stats), sum(s.dispatch_s for s in stats),
                          sum(s.combine_s for s in stats)], dtype=torch.float64, device=dev)
        mx = torch.stack([torch.as_tensor(s.max_nodes_per_token, dtype=torch.float64, device=dev)
                          for s in stats]).amax().reshape(1)
        torch.distributed.all_reduce(v, group=self.dims.group("dp"))
        torch.distributed.all_reduce(mx, op=torch.distributed.ReduceOp.MAX, group=self.dims.group("dp"))
        for s in stats:
            s.reset()
        v = torch.cat([v, mx]).tolist()
        return {"ep_cross_node_tokens": int(v[0]), "ep_max_nodes_per_token": int(v[3]),
                "ep_dispatch_s": v[1] / self.dims.dp, "ep_combine_s": v[2] / self.dims.dp}

    @torch.no_grad()
    def update_expert_bias(self, gamma: float) -> list[torch.Tensor]:
        """Sign-rule bias update from this step's expert load (whole global batch); resets the counters."""
        if self.pipe is not None:   # DualPipe twins each counted their own direction's micro-batches
            self.pipe.sum_replica_loads({n: b for n, b in self.model.named_buffers() if n.endswith("tokens_per_expert")})
        if not self.model.moe_layers():
            return []
        loads = all_reduce_sum_(self.model.expert_loads(), self.dims)   # the global batch: one collective
        self.model.update_expert_bias(gamma, loads)
        return list(loads.unbind(0))

    def validate(self, step: int) -> float:
        """Validation loss over all of ``self.val`` (logged); with data.val_blend also per source."""
        per_source = {}
        with self.phase("validation" if step else "validation before the first step", step=step):
            val_loss = self.evaluate()
            if len(self.val_sources) > 1:
                per_source = {f"val_loss/{name}": self.evaluate(b) for name, b in self.val_sources.items()}
        self.logger.log_eval(step, val_loss, per_source)
        return val_loss

    @torch.no_grad()
    def evaluate(self, batches: list | None = None) -> float:
        batches = self.val if batches is None else batches
        self.model.eval()
        if self.pipe is not None:
            with self.autocast:
                loss = self.pipe.evaluate(batches)
            self.model.train()
            return loss
        losses = []
        for ids, lab in batches:
            with self.autocast:
                logits = self.model(ids.to(self.device))
            losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                            lab.to(self.device).flatten()).item())
        self.model.train()
        for moe in self.model.moe_layers():   # evaluation traffic is not part of the next step's counters
            if hasattr(moe.dispatcher, "stats"):
                moe.dispatcher.stats.reset()
        return float(sum(losses) / max(len(losses), 1))


def _windows(skipped: list) -> str:
    """``[[2, 4], [2, 4], [9, 11]]`` -> ``2-4 (x2), 9-11``."""
    seen = {}
    for a, b in skipped:
        seen[(a, b)] = seen.get((a, b), 0) + 1
    return ", ".join(f"{a}-{b}" + (f" (x{n})" if n > 1 else "") for (a, b), n in seen.items()) or "none"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"
