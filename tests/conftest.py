import os

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NCCL-strict p2p (parallel/pipeline/p2p.py): every pipeline transfer carries a header that its receiver
# checks, so a send/receive order that NCCL would pair wrongly fails here instead of passing on gloo.
# Inherited by spawned ranks and torchrun subprocesses.
os.environ.setdefault("DSV3_NCCL_STRICT", "1")

# How the Triton kernels run (the interpreter without CUDA), chosen before any test module imports a kernel module:
# a module imported first (bench.step_variants imports kernels.quant) would otherwise fix them compiled, and every
# later interpreted kernel test would fail with "0 active drivers".
import kernels  # noqa: E402

kernels.configure()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on a 2-core machine: one intra-op thread per worker avoids oversubscription.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Long tests (``@pytest.mark.slow``) first, in their collected order: under ``-n 2`` a two-minute test that
    starts last leaves the other worker idle for its length at the end of the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
