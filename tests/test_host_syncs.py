"""Host synchronisations of a training step (``tools/host_syncs.py``): on CUDA each one stalls the launch
queue, so the step may make only the ones listed, with their reasons, in ``tools.host_syncs.EXPECTED``
(quoted in docs/gpu.md). Counted on CPU by patching the calls that would synchronise a GPU."""
import json

import pytest
import torch

from parallel.dims import ParallelDims
from tools.host_syncs import EXPECTED, HostSyncAudit, audit_steps

from .dist_utils import spawn

FAST = ["logging.wandb.mode=disabled", "logging.progress=false", "train.eval_every=0"]


def _sites_of(rank, world, overrides, out_dir):
    from hydra import compose, initialize_config_module

    from configs.schema import register, to_object, validate
    register()
    with initialize_config_module("configs", version_base=None):
        cfg = validate(to_object(compose("config", overrides=["+exp=tiny", *FAST, f"data.cache_dir={out_dir}/cache",
                                                               *overrides])), world)
    dims = ParallelDims(world_size=world, rank=rank, pp=cfg.parallel.pp, ep=cfg.parallel.ep,
                        ranks_per_node=cfg.parallel.ranks_per_node)
    if world > 1:
        dims.build_groups()
    from trainer.train import Trainer
    audit = audit_steps(Trainer(cfg, out_dir / f"run{rank}", dims, torch.device("cpu")))
    (out_dir / f"sites{rank}.json").write_text(json.dumps(sorted(audit.calls)))


LAYOUTS = {   # name: (world, overrides)
    "single": (1, []),
    "ep2-flat": (2, ["parallel.ep=2", "parallel.ep_dispatcher=alltoall"]),
    "dualpipe-ep2-zero1-fp8dispatch": (4, ["parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe",
                                           "parallel.overlap=true", "parallel.zero=1", "parallel.fp8_dispatch=true"]),
}


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    sites = {}
    for name, (world, overrides) in LAYOUTS.items():
        out = tmp_path_factory.mktemp(name)
        if world == 1:
            _sites_of(0, 1, overrides, out)
        else:
            spawn(_sites_of, world, out, overrides, out)
        sites[name] = {tuple(s) for r in range(world) for s in json.loads((out / f"sites{r}.json").read_text())}
    return sites


@pytest.mark.slow
def test_step_makes_only_the_listed_host_syncs(observed):
    for name, sites in observed.items():
        unexpected = sorted(s for s in sites if s not in EXPECTED)
        assert not unexpected, f"{name}: host syncs not in tools.host_syncs.EXPECTED (remove them, or add them " \
                               f"with the reason they are needed): {unexpected}"


@pytest.mark.slow
def test_every_listed_host_sync_is_still_made(observed):
    """The list stays honest: each entry is seen in at least one of the layouts above."""
    seen = set().union(*observed.values())
    stale = sorted(k for k in EXPECTED if k not in seen)
    assert not stale, f"tools.host_syncs.EXPECTED lists host syncs no tested layout makes any more: {stale}"


def test_audit_counts_scalar_reads_and_data_dependent_shapes():
    x = torch.arange(6.0)
    with HostSyncAudit() as audit:
        x.sum().item()
        float(x[0])
        x[x > 2]                     # boolean-mask indexing
        torch.nonzero(x)
        x.repeat_interleave(torch.tensor([1, 0, 1, 2, 0, 1]))
        x.repeat_interleave(torch.tensor([1, 0, 1, 2, 0, 1]), output_size=5)   # sized: no sync
        x[torch.tensor([0, 2])]      # integer indexing: no sync
        torch.where(x > 1, x, 0)     # three-argument where: no sync
    ops = sorted(op for (_, _, op) in audit.calls)
    assert ops == ["bool-mask index", "float", "item", "nonzero", "repeat_interleave"], audit.calls
    assert all(path == "tests/test_host_syncs.py" for path, _, _ in audit.calls)
    assert torch.Tensor.item is not None and "wrapper" not in torch.Tensor.item.__name__   # restored
