"""Cross-check: our DualPipeV executor and torch.distributed.pipelining.ScheduleDualPipeV give the same
gradients on the same tiny stages (tanh MLP layers, MSE loss)."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.dims import ParallelDims
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.p2p import PipeChannels
from parallel.pipeline.schedules import get_schedule

from .dist_utils import rel_err, spawn

D, B, T, N_MB = 8, 8, 4, 8


class ToyStage(nn.Module):
    """What the executor needs of a ``parallel.pipeline.stages.Stage``: ``steps`` (here one piece, no cuts, no
    balance losses); the first stage reads the float input in place of token ids, the last stage returns the MSE
    loss against the labels."""

    def __init__(self, layer: nn.Module, stage: int, n_stages: int):
        super().__init__()
        self.layer, self.stage = layer, stage
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1

    def forward(self, x, inputs, labels, mtp_weight=0.0):
        h = self.layer(inputs if self.is_first else x)
        if not self.is_last:
            return h, None
        loss = ((h - labels) ** 2).mean()
        return loss, (loss.detach(), torch.zeros(()))

    def steps(self, x, inputs, labels, mtp_weight=0.0):
        out, parts = self(x, inputs, labels, mtp_weight)
        return out, parts, None
        yield                                          # a generator without cuts


def _worker(rank, world):
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    n_stages = 2 * world
    torch.manual_seed(0)
    full = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n_stages)]
    x = torch.randn(B * N_MB // 4, T, D, generator=torch.Generator().manual_seed(1))
    y = torch.randn(B * N_MB // 4, T, D, generator=torch.Generator().manual_seed(2))
    mine = [rank, n_stages - 1 - rank]

    # ours
    ours = {c: ToyStage(copy.deepcopy(full[s]), s, n_stages) for c, s in enumerate(mine)}
    actions = get_schedule("dualpipev", world, N_MB)[rank]
    channels = PipeChannels(ParallelDims(world_size=world, rank=rank, pp=world).build_groups())
    ex = PipelineExecutor(ours, actions, channels, n_stages, D)
    mb = x.shape[0] // N_MB
    ex.step([(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]) for i in range(N_MB)], 1.0 / N_MB)

    # torch
    theirs = [copy.deepcopy(full[s]) for s in mine]
    stages = [PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(theirs, mine)]
    sched = ScheduleDualPipeV(stages, n_microbatches=N_MB, loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean())
    losses = []
    if rank == 0:
        sched.step(x, target=y, losses=losses)
    else:
        sched.step()
    for c in (0, 1):
        for (name, p), q in zip(ours[c].layer.named_parameters(), theirs[c].parameters()):
            assert p.grad is not None and q.grad is not None, name
            assert rel_err(p.grad, q.grad) < 1e-6, (rank, c, name, rel_err(p.grad, q.grad))
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_dualpipev_matches_torch_schedule(tmp_path, world):
    spawn(_worker, world, tmp_path)
