"""Multi-process test harness: ranks started from a forkserver + gloo + a file rendezvous in a tmp dir.

The forkserver (one per pytest process, started at the first ``spawn``) has imported torch, DTensor, DCP and the
trainer once (none of them reads the environment when imported, and none imports Triton's kernels, which
``kernels.configure`` must precede), so a rank starts in ~0.1 s of CPU instead of the seconds a fresh
interpreter spends importing them (torch alone ~1.6 s; `tests/test_ep.py`'s parity cases: 47 s instead of 80 s). Otherwise a rank
is what ``torch.multiprocessing.spawn`` makes: the caller's ``sys.path`` and working directory (multiprocessing's
preparation data), and the caller's environment at the call, set before ``fn`` and its module are unpickled."""
import gc
import os
import pickle
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

mp.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
                           "models", "parallel.ep", "parallel.zero", "trainer.train"])


def _entry(rank, env, payload):
    os.environ.clear()
    os.environ.update(env)
    world_size, store_path, fn, args, timeout_s = pickle.loads(payload)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        # Drop what ``fn`` left in reference cycles (a Trainer, its dispatchers and optimizer hold process groups)
        # so that destroying the groups joins their worker threads now: a gloo worker that releases a finished
        # work's tensors after the interpreter began shutting down aborts the process (std::terminate).
        gc.collect()
        dist.destroy_process_group()


def spawn(fn, world_size: int, tmp_path, *args, timeout_s: float = 300) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; failures re-raise here."""
    # A new rendezvous file per call: a test that spawns twice must not meet the first group's leftover keys
    # (a rank of the second group once dialled a port of the first, "Connection refused").
    store = tmp_path / f"store-{os.getpid()}-{world_size}-{uuid.uuid4().hex[:8]}"
    payload = pickle.dumps((world_size, str(store), fn, args, timeout_s))
    mp.start_processes(_entry, args=(dict(os.environ), payload), nprocs=world_size, join=True,
                       start_method="forkserver")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a-b|| / ||b|| (0 when both are zero)."""
    a, b = a.detach(), b.detach()
    den = b.double().norm()
    num = (a.double() - b.double()).norm()
    return float(num / den) if den > 0 else float(num)


def grads_with_reference(model, ref_model, dims):
    """Yield ``(name, grad, reference grad)`` for every parameter of the (expert-sharded) ``model``;
    routed-expert references are sliced to this rank's shard."""
    from parallel.ep import is_expert_param
    expert = is_expert_param(model)
    ref = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        g_ref = ref[name].grad
        if expert[name]:
            n = p.shape[0]
            g_ref = g_ref[dims.ep_rank * n:(dims.ep_rank + 1) * n]
        yield name, p.grad, g_ref
