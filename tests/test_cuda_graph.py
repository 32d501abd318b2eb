"""``train.cuda_graph`` (``parallel/cuda_graph.py``): the step's forward and backward replayed from a CUDA graph
trains as the eager step does.

On the CPU a stand-in for CUDA graphs (``RerunGraphs``) checks the bookkeeping around the graph with the trainer:
warm-up steps, the key that captures again, the gradients handed back to the optimizer after each replay, the
eager fallback after a failed capture. Its replay runs the captured function again and writes the results into the
tensors the capture left (where a CUDA graph writes), then drops the optimizer's references to them, as the
optimizer's step does. On CUDA (the GPU suite's kernel part) the real graphs train the tiny model as eager does."""
import contextlib
import logging
import traceback
from pathlib import Path

import pytest
import torch

import models
from configs import model_preset
from errors import ConfigError
from parallel.cuda_graph import WARMUP, CudaGraphs, GraphedStep, enabled
from parallel.dims import ParallelDims
from parallel.zero import build_optimizer
from trainer.train import Trainer

from .test_trainer import SMALL, cache  # noqa: F401 - the same small run and data-cache fixture
from .trainer_utils import fast_overrides, make_config

STEPS = WARMUP + 2
LITTLE = ["train.global_batch_size=4", "train.micro_batch_size=2", "data.seq_len=32"]   # two micro-batches per step


class RerunGraphs:
    """CPU stand-in for ``CudaGraphs`` (see the module docstring)."""

    def __init__(self, opt, fail: bool = False):
        self.opt, self.fail, self.captures, self.replays = opt, fail, 0, 0

    def eager(self, fn):
        return fn()

    def capture(self, fn):
        self.captures += 1
        if self.fail:
            fn()   # a capture fails part-way, after the backward has left gradients behind
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        out = fn()
        return (fn, out, self.opt.held_grads()), out

    def replay(self, graph) -> None:
        self.replays += 1
        fn, out, (grads, fp32) = graph
        self.opt.zero_grad()
        new = fn()
        new_grads, new_fp32 = self.opt.held_grads()
        out.copy_(new)
        for held, fresh in ((grads, new_grads), (fp32, new_fp32)):
            assert held.keys() == fresh.keys()
            for p, t in held.items():
                assert t.dtype == fresh[p].dtype
                t.copy_(fresh[p])
        self.opt.zero_grad()   # only the tensors the capture left hold this step's gradients now


def _trainer(tmp_path, cache, name, *overrides):  # noqa: F811 - cache is the fixture
    """On the CPU on every machine: the stand-in's bit-for-bit checks need a deterministic backward (CUDA's
    scatter-adds are not; the CUDA test below compares real graphs)."""
    return Trainer(make_config(*fast_overrides(tmp_path, cache), *SMALL, *LITTLE, "train.device=cpu", *overrides),
                   tmp_path / name)


def _graphed(tr: Trainer, fail: bool = False) -> RerunGraphs:
    graphs = RerunGraphs(tr.opt, fail)
    tr.graphed = GraphedStep(lambda ids, labels, mtp_w: tr.forward_backward(ids, labels, mtp_w), tr.model, tr.opt,
                             graphs)
    return graphs


def _train(tr: Trainer, steps: int = STEPS) -> list[float]:
    return [tr.train_step()["loss"] for _ in range(steps)]


def _same_weights(a: Trainer, b: Trainer) -> None:
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    for (n, p), (_, q) in zip((a.opt.master_weights() or {}).items(), (b.opt.master_weights() or {}).items()):
        assert torch.equal(p, q), n


def test_replayed_steps_train_as_eager_ones(tmp_path, cache):  # noqa: F811
    """BF16 weights, two micro-batches per step (FP32 accumulators behind the gradients), WARMUP eager steps, one
    capture, then replays: the same losses, weights and master, bit for bit."""
    eager = _trainer(tmp_path, cache, "e", "train.precision=bf16")
    graphed = _trainer(tmp_path, cache, "g", "train.precision=bf16")
    graphs = _graphed(graphed)
    assert _train(graphed) == _train(eager)
    assert (graphs.captures, graphs.replays) == (1, STEPS - WARMUP)
    _same_weights(graphed, eager)


def test_a_new_mtp_weight_or_moved_parameter_captures_again(tmp_path, cache):  # noqa: F811
    """FP32 weights (the gradients in ``.grad``). The MTP loss weight is baked into the graph: a schedule that
    changes it runs WARMUP eager steps with the new weight, then captures a new graph; a parameter whose storage
    was replaced (a reload) captures again at once."""
    switch = ["train.mtp_loss_weight.value=0.3", "train.mtp_loss_weight.then=0.1",
              f"train.mtp_loss_weight.after_steps={WARMUP + 1}"]
    eager, graphed = _trainer(tmp_path, cache, "e", *switch), _trainer(tmp_path, cache, "g", *switch)
    graphs = _graphed(graphed)
    assert _train(graphed, 2 * WARMUP + 1) == _train(eager, 2 * WARMUP + 1)
    assert (graphs.captures, graphs.replays) == (1, 1)
    graphed.train_step()
    assert (graphs.captures, graphs.replays) == (2, 2)
    p = next(graphed.model.parameters())
    p.data = p.data.clone()
    graphed.train_step()
    assert (graphs.captures, graphs.replays) == (3, 3)


def test_a_failed_capture_runs_eagerly_with_one_warning(tmp_path, cache, caplog):  # noqa: F811
    eager, graphed = _trainer(tmp_path, cache, "e"), _trainer(tmp_path, cache, "g")
    graphs = _graphed(graphed, fail=True)
    with caplog.at_level(logging.WARNING, logger="parallel"):
        assert _train(graphed) == _train(eager)
    warned = [r.getMessage() for r in caplog.records if "train.cuda_graph" in r.getMessage()]
    assert warned == ["train.cuda_graph: capturing the forward and backward failed (RuntimeError: operation not "
                      "permitted when stream is capturing); every step runs eagerly"]
    assert graphs.captures == 1 and graphs.replays == 0
    _same_weights(graphed, eager)


@contextlib.contextmanager
def host_to_device_copies():
    """Yields a list that collects each copy from a host tensor into a device one (``to``, ``cuda``, ``copy_``):
    torch waits for a copy from pageable memory, and a graph's replay would read the host buffer again."""
    found, saved = [], {n: getattr(torch.Tensor, n) for n in ("to", "cuda", "copy_")}

    def watch(name):
        def wrapper(self, *args, **kwargs):
            out = saved[name](self, *args, **kwargs)
            src = args[0] if name == "copy_" else self
            dst = self if name == "copy_" else out
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device.type != "cpu":
                caller = traceback.extract_stack(limit=2)[0]
                found.append(f"{name} of {tuple(src.shape)} at {Path(caller.filename).name}:{caller.lineno}")
            return out
        return wrapper
    for name in saved:
        setattr(torch.Tensor, name, watch(name))
    try:
        yield found
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_forward_and_backward_have_nothing_a_graph_cannot_capture(monkeypatch):
    """The tiny model's forward and backward with BF16 weights, through the optimizer's gradient hooks, on the
    meta device standing in for CUDA (the model's code is the same on every device): no copy from the host. A
    read of a device value on the host fails on meta tensors (``tools.host_syncs`` lists the step's others)."""
    is_autocast_enabled = torch.is_autocast_enabled   # meta has no autocast: off, as it is here on CPU
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: False if a == ("meta",) else is_autocast_enabled(*a))
    cfg = make_config()
    model = models.build(cfg.model, device="meta").train()
    opt = build_optimizer(model, cfg.optim, ParallelDims(world_size=1), weights="bf16")
    ids = torch.zeros(2, 33, dtype=torch.long, device="meta")
    with host_to_device_copies() as copies:
        out = model.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3, aux_alpha=1e-4)
        opt.backward(out.loss)
        seeded = torch.arange(3).to("meta")   # what it catches
    assert copies[-1].startswith("to of (3,) at test_cuda_graph.py:") and seeded.is_meta
    assert copies[:-1] == []


def test_auto_graphs_one_process_on_cuda_and_on_is_refused_elsewhere():
    assert enabled("auto", "cuda", 1) and enabled("on", torch.device("cuda"), 1) and enabled("on", "cuda", 1, "fp32")
    assert not enabled("auto", "cuda", 2) and not enabled("auto", "cpu", 1) and not enabled("off", "cuda", 1)
    assert not enabled("auto", "cuda", 1, "fp32")   # the reference precision stays eager
    assert not enabled("auto", "cuda", 1, "bf16", "selective") and enabled("on", "cuda", 1, "bf16", "full")
    with pytest.raises(ValueError, match="train.cuda_graph: 'true' is not one of auto, on, off"):
        enabled("true", "cuda", 1)
    with pytest.raises(ConfigError, match="train.cuda_graph: 'yes' is not one of"):
        make_config("train.cuda_graph=yes")
    make_config("parallel.zero=1", world_size=2)   # auto: eager there, nothing to refuse
    with pytest.raises(ConfigError, match=r"train.cuda_graph=on: one process only \(world size 2\)"):
        make_config("train.cuda_graph=on", "parallel.zero=1", world_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.cuda_graph=on needs a CUDA device"):
            make_config("train.cuda_graph=on")
    with pytest.raises(ConfigError, match=r"train.cuda_graph=on needs a CUDA device \(train.device=cpu\)"):
        make_config("train.cuda_graph=on", "train.device=cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("compile_regions", [False, True])
def test_cuda_graph_trains_the_tiny_model_as_eager_on_cuda(compile_regions):
    """The real graphs: BF16 weights (the Triton AdamW and cross-entropy kernels), two micro-batches, the compiled
    regions or eager. Kernels with atomics (index_put, scatter_add) make eager steps differ between runs too, so the
    losses are compared to a relative 1e-3 over 6 steps."""
    dev = torch.device("cuda")

    def run(graphed: bool) -> list[float]:
        model = models.build(model_preset("tiny"), device=dev, seed=0).train()
        if compile_regions:
            from parallel.compile import apply_compile
            apply_compile(model)
        from types import SimpleNamespace
        optim = SimpleNamespace(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0,
                                moment_dtype="auto")
        opt = build_optimizer(model, optim, ParallelDims(world_size=1), weights="bf16")
        gen = torch.Generator().manual_seed(0)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)

        def fwd_bwd(ids, labels, mtp_w):
            sums = torch.zeros(3, device=dev)
            for i, lab in zip(ids.split(2), labels.split(2)):
                with autocast:
                    out = model.compute_loss(i, lab, mtp_weight=mtp_w, aux_alpha=1e-4)
                opt.backward(out.loss / 2)
                sums += torch.stack([out.lm_loss, out.mtp_loss, out.aux_loss]).float()
            return sums
        step = GraphedStep(fwd_bwd, model, opt, CudaGraphs(dev)) if graphed else None
        losses = []
        for _ in range(WARMUP + 4):
            toks = torch.randint(0, model.cfg.vocab_size, (4, 65), generator=gen).to(dev)
            args = (toks[:, :-1], toks[:, 1:])
            sums = step(args, (0.3,)) if graphed else fwd_bwd(*args, 0.3)
            assert bool(torch.isfinite(sums).all() & opt.grads_finite())
            opt.step(1.0)
            opt.zero_grad()
            model.update_expert_bias(1e-3)
            losses.append(sums[0].item() / 2)
        if graphed:
            assert step.failed is None and step.graph is not None
        return losses
    eager, graphed = run(False), run(True)
    for e, g in zip(eager, graphed):
        assert abs(e - g) <= 1e-3 * abs(e), (eager, graphed)


def test_the_layout_line_says_whether_the_step_is_graphed_and_why_not():
    from types import SimpleNamespace as NS

    from trainer.startup import graph_note

    def trainer(mode="auto", world=1, weights="bf16", recompute="none", graphed=None, device="cuda"):
        return NS(cfg=NS(train=NS(cuda_graph=mode, recompute=recompute)), dims=NS(world_size=world),
                  precision=NS(weights=weights), graphed=graphed, device=torch.device(device))
    assert graph_note(trainer(device="cpu")) == ""
    assert graph_note(trainer(graphed=object())) == \
        f"; forward and backward replayed from a CUDA graph after {WARMUP} eager steps"
    assert graph_note(trainer(weights="fp32")) == "; eager steps, no CUDA graph (FP32 weights)"
    assert graph_note(trainer(world=4)) == "; eager steps, no CUDA graph (4 processes)"
    assert graph_note(trainer(mode="off")) == "; eager steps, no CUDA graph (train.cuda_graph=off)"
    assert graph_note(trainer(recompute="selective")) == "; eager steps, no CUDA graph (train.recompute=selective)"
