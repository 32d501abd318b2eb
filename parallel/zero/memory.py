"""Per-rank memory of the training state, measured and by formula.

With ``P_d`` dense and ``P_e`` routed-expert parameters held by this rank (after the pipeline split and
EP), data-parallel size ``dp`` and expert-data-parallel size ``edp = dp / ep``, and shard size
``S = P_d / dp + P_e / edp``::

                 zero=0            zero=1            zero=2
    parameters   w (P_d + P_e)     w (P_d + P_e)     w (P_d + P_e)      model weights, w bytes each
    gradients    4 (P_d + P_e)     4 (P_d + P_e)     4 S (pp = 1)       fp32 accumulation (zero=2: the shard)
    master       M                 4 S               4 S                fp32 master copy
    optimizer    2 m (P_d + P_e)   2 m S             2 m S              AdamW exp_avg + exp_avg_sq, m bytes each

``m`` is 2 for BF16 moments and 4 for FP32. ``w`` is 4 with ``train.precision=fp32`` (FP32 weights, also
the master copy without ZeRO: ``M = 0``) and 2 with bf16 / fp8, DeepSeek-V3's BF16 compute weights (``M = 4
(P_d + P_e)``: a full FP32 master on every rank without ZeRO; ``master.py``). Gradients are FP32 either way
(FP32 accumulators beside BF16 weights; a BF16 gradient of one backward comes on top while it is added in).
Measured numbers count the tensors the optimizer really allocated (shards are padded to equal size, so they
can exceed the formula by a few elements per parameter); zero=2 frees each bucket's full gradients after
its reduce-scatter, so ``gradients`` is what persists across micro-batches (a bucket in flight comes on top).
With a pipeline (pp > 1) zero=2 keeps full gradients, as zero=1: the executor drives the backward, the
gradients accumulate over the step's micro-batches (DualPipe's replica sums need them whole) and are
reduce-scattered once, at the step. Sharding them there would take a reduce-scatter per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..dims import ParallelDims
from ..ep import is_expert_param

KEYS = ("params", "grads", "master", "optim")


@dataclass
class MemoryReport:
    measured: dict[str, int]
    formula: dict[str, int]
    dense_params: int
    expert_params: int

    @property
    def total(self) -> int:
        return sum(self.measured.values())

    def line(self) -> str:
        gib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        parts = [f"{k} {gib(self.measured[k])} (formula {gib(self.formula[k])})" for k in KEYS]
        return (f"memory per rank: {', '.join(parts)}; total {gib(self.total)} "
                f"[{self.dense_params:,} dense + {self.expert_params:,} expert parameters here]")


def formula(dense: float, expert: float, dp: int, edp: int, zero: int, moment_bytes: int,
            weight_bytes: int = 4, pp: int = 1, master_bytes: int = 4) -> dict[str, int]:
    """The table above, in bytes per rank; ``master_bytes``: 2 for a split master (``optim.master=split``: the
    BF16 weight is its high half, so only the low halves are extra)."""
    full = dense + expert
    shard = dense / dp + expert / edp
    return {"params": round(weight_bytes * full),
            "grads": round(4 * (shard if zero >= 2 and pp == 1 else full)),
            "master": round(master_bytes * (shard if zero >= 1 else 0 if weight_bytes == 4 else full)),
            "optim": round(2 * moment_bytes * (shard if zero >= 1 else full))}


def account(model: nn.Module, dims: ParallelDims, zero: int, moment_bytes: int, measured: dict[str, int],
            weight_bytes: int = 4, master_bytes: int = 4) -> MemoryReport:
    expert = is_expert_param(model)
    n_dense = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and not expert[n])
    n_expert = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and expert[n])
    return MemoryReport(measured, formula(n_dense, n_expert, dims.dp, dims.edp, zero, moment_bytes, weight_bytes,
                                          dims.pp, master_bytes),
                        n_dense, n_expert)
