"""Runs one pipeline rank's action list (``parallel.pipeline.schedules``) over torch.distributed p2p.

The per-step state (``_StepState``, made anew by every ``step``): stage inputs/outputs per
(micro-batch, stage), received tensors, pending sends. Sends are asynchronous (``isend``), waited for
at the end of the step, so a rank never blocks on its own send; a RECV waits until its tensor has
arrived (on CUDA the stream waits, not the host). Transfers go over one channel per direction between
neighbours and pair in issue order, as NCCL pairs them (``p2p.py``): no tags; the schedule's SEND/RECV
order is FIFO-consistent.

One path per action kind: a stage forward is the model's own steps (``Stage.steps``) recorded on a
``Tape`` (``overlap.py``), a backward runs the tape's pieces in reverse. F runs a forward; BW the full
backward of a stage. The zero-bubble split: B differentiates the stage input and the non-GEMM parameters
(norms, gate, embedding) and frees the graph, while the stage's deferred modules queue their weight-gradient
GEMMs in the executor's ``WeightGradQueue`` under (micro-batch, stage) (``parallel/wgrad.py``); W runs only
those GEMMs. So W issues no collective and recomputes nothing. Without a queue (an executor built on plain
modules) nothing is deferred: B computes every gradient and W has nothing left to do.
With ``overlap`` and a schedule that has F&B actions (DualPipe, DualPipeV) the tapes cut
every stage at its expert all-to-alls and an F&B interleaves its forward and backward pieces in this
thread (``run_pair``), so that one micro-batch's all-to-all is in flight while the other computes.
Otherwise a tape is one piece (its all-to-alls exchanged at once, with autograd) and an F&B runs its two
halves one after the other: the reference the overlapped run is tested against.

Shapes: activations and their gradients crossing stages are ``[micro_batch, seq, dim]`` in ``wire_dtype``: the
residual stream's dtype, which is the weights' (FP32, or BF16 with ``train.precision=bf16|fp8``, whose
autocast keeps the stream BF16). A stage output of another dtype is an error, not a silent cast: a BF16
wire would round an FP32 stream, and an FP32 one would turn the next stage's BF16 stream into FP32 (type
promotion in the residual adds), unlike the single-device model.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .overlap import Tape, backward_steps, record, run, run_pair
from ..errors import named
from ..wgrad import WeightGradQueue
from .p2p import PipeChannels
from .schedules.actions import Action, Kind, Payload
from .stages import Stage


@dataclass
class _StepState:
    """What one ``PipelineExecutor.step`` keeps between its actions; keys are ``(micro-batch, stage)``
    (received tensors: ``(payload, micro-batch, stage)``)."""
    mb: list[tuple[torch.Tensor, torch.Tensor]]   # the step's micro-batches (ids, labels)
    scale: float                                  # the loss scale
    mtp_weight: float
    aux_alpha: float
    sums: dict[str, torch.Tensor]   # on the device: the host does not wait for each micro-batch's losses
    inputs: dict = field(default_factory=dict)     # stage input leaves
    outputs: dict = field(default_factory=dict)    # stage outputs, until their backward
    recv: dict = field(default_factory=dict)       # received activations and gradients
    in_grads: dict = field(default_factory=dict)   # stage input gradients, until sent or used on this rank
    tapes: dict = field(default_factory=dict)      # recorded stage forwards, until their backward
    fb_pieces: list[tuple] = field(default_factory=list)   # overlapped F&Bs: (half, compute s, wait s, injected s)
    sends: list = field(default_factory=list)      # (work, tensor) of the step's isends


class PipelineExecutor:
    def __init__(self, stages: dict[int, Stage], actions: list[Action], channels: PipeChannels, n_stages: int,
                 dim: int, device: torch.device | str = "cpu", overlap: bool = True,
                 wgrad: WeightGradQueue | None = None, wire_dtype: torch.dtype = torch.float32):
        self.stages = stages                   # chunk -> Stage
        self.actions = actions
        self.p2p = channels                    # directional channels to the neighbouring pipeline ranks
        self.n_stages = n_stages
        self.dim = dim
        self.device = torch.device(device)
        # Cutting stages at their all-to-alls only pays off around F&B actions (DualPipe, DualPipeV).
        self.overlap = overlap and any(a.kind is Kind.FB for a in actions)
        self.state: _StepState | None = None   # the running step's (after it: the last step's)
        # B/W: the queue the stages' deferred modules use (``apply_deferred_wgrad``); an empty one defers nothing
        self.wgrad = wgrad if wgrad is not None else WeightGradQueue()
        self.wire_dtype = wire_dtype   # activations and their gradients between stages (the residual stream)

    # ---- one optimizer step's worth of micro-batches ----------------------------------------------
    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float,
             mtp_weight: float = 0.0, aux_alpha: float = 0.0) -> dict[str, torch.Tensor]:
        """Run the action list. Returns sums over the micro-batches finished on this rank:
        ``{"lm": , "mtp": , "aux": , "n": }`` (detached scalars)."""
        sums = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in ("lm", "mtp", "aux", "n")}
        self.state = _StepState(micro_batches, loss_scale, mtp_weight, aux_alpha, sums)
        clock = _Clock(self.device)
        for i, a in enumerate(self.actions):
            t0 = clock.now()
            with named(f"pipeline rank {self.p2p.pp_rank}, action {i} ({a})"):
                getattr(self, "_" + a.kind.name.lower())(a)
            if a.is_compute:
                clock.add(a.kind, t0, clock.now())
        # compute action times and the span from the first compute start to the last compute end, this step
        self.durations, self.span_s = clock.read()
        with named(f"pipeline rank {self.p2p.pp_rank}, the step's sends"):
            for work, _ in self.state.sends:
                work.wait()
        self.state.sends.clear()
        leftovers = set(self.state.outputs) | set(self.state.inputs)
        assert not leftovers, f"pipeline step ended with un-backpropagated (micro-batch, stage): {sorted(leftovers)}"
        no_w = self.wgrad.pending()
        assert not no_w, f"pipeline step ended with deferred weight gradients never run by a W: (micro-batch, stage) {no_w}"
        return self.state.sums

    # ---- compute ---------------------------------------------------------------------------------
    def _stage_input(self, a: Action) -> torch.Tensor | None:
        if self.stages[a.chunk].is_first:
            return None
        src = self.state.recv.pop((Payload.ACT, a.mb, a.stage - 1), None)
        if src is None:                                 # previous stage on this rank (DualPipeV's turn)
            src = self.state.outputs[(a.mb, a.stage - 1)]
        x = src.detach().requires_grad_()
        self.state.inputs[(a.mb, a.stage)] = x
        return x

    def _record(self, a: Action, out: torch.Tensor, aux: torch.Tensor | None, parts) -> None:
        self.state.outputs[(a.mb, a.stage)] = out
        if aux is not None and self.state.aux_alpha:
            self.state.sums["aux"] += (self.state.aux_alpha * aux.detach()).double()
        if parts is not None:
            self.state.sums["lm"] += parts[0].detach().double()
            self.state.sums["mtp"] += parts[1].detach().double()
            self.state.sums["n"] += 1

    def _f(self, a: Action) -> None:
        run(self._f_steps(a))

    def _f_steps(self, a: Action):
        """A stage forward on a tape (cut at its all-to-alls with ``overlap``): its output and its MoE balance
        losses end the tape, whose backward seeds them."""
        st, s = self.stages[a.chunk], self.state
        ids, labels = (t.to(self.device) for t in s.mb[a.mb])
        x = self._stage_input(a)
        tape = Tape(x, cuts=self.overlap)
        out, parts, aux = yield from record(_stage_steps(st, x, ids, labels, s.mtp_weight), tape)
        tape.finish([out, aux])
        s.tapes[(a.mb, a.stage)] = tape
        self._record(a, out, aux, parts)

    def _out_grads(self, a: Action) -> list[torch.Tensor | None]:
        """Gradients of the stage output (the loss scale on the last stage, else the next stage's) and of
        its balance losses (``aux_alpha`` x the loss scale; None without them)."""
        s = self.state
        if self.stages[a.chunk].is_last:
            g = torch.full((), s.scale, dtype=s.outputs[(a.mb, a.stage)].dtype, device=self.device)
        else:
            g = s.recv.pop((Payload.GRAD, a.mb, a.stage + 1), None)
            g = g if g is not None else s.in_grads.pop((a.mb, a.stage + 1))
        aux = torch.full((), s.aux_alpha * s.scale, device=self.device) if s.aux_alpha else None
        return [g, aux]

    def _bw(self, a: Action) -> None:
        run(self._bw_steps(a))

    def _bw_steps(self, a: Action):
        tape = self.state.tapes.pop((a.mb, a.stage))
        yield from backward_steps(tape, self._out_grads(a))
        self._finish_backward(a)

    def _b(self, a: Action) -> None:
        """B: gradients of the stage input and of the non-deferred parameters, piece by piece; the deferred
        dW GEMMs wait in the queue under (micro-batch, stage). The graph is freed here."""
        key, params = (a.mb, a.stage), self._params(self.stages[a.chunk])
        with self.wgrad.collect(key):
            run(backward_steps(self.state.tapes.pop(key), self._out_grads(a),
                               lambda leaves: self.wgrad.b_inputs(leaves, params)))
        self._finish_backward(a)

    def _w(self, a: Action) -> None:
        """W: the weight-gradient GEMMs its B queued (no collective, no graph)."""
        self.wgrad.run((a.mb, a.stage))

    def _finish_backward(self, a: Action) -> None:
        self.state.outputs.pop((a.mb, a.stage))
        x = self.state.inputs.pop((a.mb, a.stage), None)
        if x is not None:
            self.state.in_grads[(a.mb, a.stage)] = x.grad

    def _fb(self, a: Action) -> None:
        """F&B: with ``overlap`` the forward half's and the backward half's pieces alternate in this
        thread (``overlap.run_pair``): each all-to-all travels while the other micro-batch computes its
        next piece. Without it the halves run one after the other."""
        fwd, bwd = a.parts()
        if self.overlap:
            run_pair(self._f_steps(fwd), self._bw_steps(bwd), self.state.fb_pieces)
        else:
            self._f(fwd)
            self._bw(bwd)

    # ---- communication ---------------------------------------------------------------------------
    def _send(self, a: Action) -> None:
        if a.payload is Payload.ACT:
            t = self.state.outputs[(a.mb, a.stage)].detach()
        else:
            t = self.state.in_grads.pop((a.mb, a.stage))
        if t.dtype != self.wire_dtype:
            raise RuntimeError(f"pipeline rank {self.p2p.pp_rank}: stage {a.stage} {a.payload.name.lower()} of micro-batch "
                               f"{a.mb} is {t.dtype}, the wire carries {self.wire_dtype} (the residual stream's dtype: "
                               "the weights' with train.precision); a cast would change the numerics")
        t = t.contiguous()
        self.state.sends.append((self.p2p.isend(t, a.peer, (a.payload.value, a.mb, a.stage)), t))

    def _recv(self, a: Action) -> None:
        ids = self.state.mb[a.mb][0]
        buf = torch.empty(ids.shape[0], ids.shape[1], self.dim, device=self.device, dtype=self.wire_dtype)
        self.state.recv[(a.payload, a.mb, a.stage)] = self.p2p.recv(buf, a.peer, (a.payload.value, a.mb, a.stage))

    # ---- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _params(st: Stage) -> list[torch.Tensor]:
        params = [p for p in st.parameters() if p.requires_grad]
        if st.is_last and hasattr(st, "_borrowed"):
            params += [p for p in st._borrowed[0].parameters() if p.requires_grad]
        return params


def _stage_steps(st, x, ids: torch.Tensor, labels: torch.Tensor, mtp_weight: float):
    """``st.steps``: the stage's part of the model, as steps; returns ``(out, parts, aux)``."""
    return (yield from st.steps(x, ids, labels, mtp_weight))


class _Clock:
    """Times of compute actions: host clock on CPU; CUDA events on the current stream on GPUs, where the
    host only launches work (read once, after the step's last action: one synchronisation per step)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Kind, object, object]] = []

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def add(self, kind: Kind, start, end) -> None:
        self.spans.append((kind, start, end))

    def read(self) -> tuple[dict[Kind, list[float]], float]:
        durations: dict[Kind, list[float]] = defaultdict(list)
        if not self.spans:
            return durations, 0.0
        if self.cuda:
            self.spans[-1][2].synchronize()
            elapsed = lambda a, b: a.elapsed_time(b) / 1e3   # noqa: E731  (ms -> s)
        else:
            elapsed = lambda a, b: b - a   # noqa: E731
        for kind, start, end in self.spans:
            durations[kind].append(elapsed(start, end))
        return durations, elapsed(self.spans[0][1], self.spans[-1][2])
