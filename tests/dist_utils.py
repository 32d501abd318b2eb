"""Multi-process test harness: ranks started from a forkserver + gloo + a file rendezvous in a tmp dir.

The forkserver (one per pytest process) has imported torch, DTensor, DCP and the trainer once (none reads the
environment or imports Triton's kernels when imported), so a rank starts in ~0.1 s instead of seconds. Otherwise a
rank is what ``torch.multiprocessing.spawn`` makes, with the caller's environment at the call."""
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


def _run_module(module: str, argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """In a forkserver child: ``python -m module *argv`` with stdout / stderr into the files ``out`` / ``err``."""
    import atexit
    import runpy
    import sys
    import traceback
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr) or 1)
    except BaseException:   # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Module:
    """``python -m module *argv`` running in a forkserver child (``start_module``): ``pid``, ``wait``, ``kill``."""

    def __init__(self, module: str, argv: list[str], env: dict, cwd):
        import tempfile
        self.args = [module, *argv]
        self._tmp = tempfile.TemporaryDirectory()
        self._out, self._err = os.path.join(self._tmp.name, "out"), os.path.join(self._tmp.name, "err")
        self.proc = mp.get_context("forkserver").Process(target=_run_module,
                                                         args=(module, argv, env, str(cwd), self._out, self._err))
        self.proc.start()
        self.pid = self.proc.pid

    def wait(self, timeout: float):
        """Its ``subprocess.CompletedProcess`` once it exits; ``subprocess.TimeoutExpired`` (it is killed) after
        ``timeout`` seconds."""
        import subprocess
        try:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout)
            read = lambda path: open(path, errors="replace").read() if os.path.exists(path) else ""   # noqa: E731
            return subprocess.CompletedProcess(["python", "-m", *self.args], self.proc.exitcode, read(self._out),
                                               read(self._err))
        finally:
            if not self.proc.is_alive():
                self._tmp.cleanup()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def start_module(module: str, argv: list[str], env: dict, cwd) -> Module:
    """``subprocess.Popen([python, "-m", module, *argv], cwd=cwd, env=env)`` with its output captured, forked from
    the forkserver (``_run_module``) instead of started afresh."""
    return Module(module, argv, env, cwd)


def run_module(module: str, argv: list[str], env: dict, cwd, timeout: float):
    """``subprocess.run([python, "-m", module, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, forked from the forkserver (``_run_module``) instead of started afresh."""
    return start_module(module, argv, env, cwd).wait(timeout)
