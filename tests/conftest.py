import os

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n 2 on a 2-core machine: one intra-op thread per worker avoids oversubscription.
    import torch

    torch.set_num_threads(1)
