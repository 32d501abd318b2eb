"""``python -m trainer +exp=tiny [key=value ...]``: parse the config, build, train, close.

Multi-process: ``torchrun --nproc_per_node=N -m trainer ...`` (gloo on CPU, NCCL on GPUs), or
``python -m trainer.torchrun`` with the same arguments: quiet when a rank fails, and its exit code.

Exit codes (``trainer.lifecycle``): 0 done, 2 config error (one line ``error: <key>: ...``; rank 0 prints an
error in the config itself, the other ranks exit in silence), 3 failed, 75 stopped on request with a checkpoint.
"""
from __future__ import annotations

import difflib
import faulthandler
import os
import signal
import socket
import sys
import time
import traceback
from importlib import resources
from pathlib import Path
from typing import NoReturn

from trainer.lifecycle import (EXIT_CONFIG, EXIT_FAILED, EXIT_STOPPED, StartupInterrupted, StartupStops, TrainingError,
                               closed_by_launcher, ignore_stops, leave_on_signal, stopped_in_startup)

# Stop signals are handled from here on (trainer.lifecycle.StartupStops): importing torch and Hydra takes
# seconds, start-up minutes at scale, and a signal's default action would end the run with nothing said.
_STOPS = StartupStops(int(os.environ.get("RANK", "0"))).install() if __name__ == "__main__" else None

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from configs.init_from import apply_init_from  # noqa: E402
from configs.schema import check_key, register, to_object, validate  # noqa: E402
from errors import ConfigError  # noqa: E402
from models.config import ModelError  # noqa: E402

register()


def _init_distributed(cfg):
    """Process group + ParallelDims for torchrun launches; (dims, device)."""
    import torch
    import torch.distributed as dist

    from parallel.dims import ParallelDims
    from trainer.train import pick_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    p = cfg.parallel
    dims = ParallelDims(world_size=world, rank=rank, pp=p.pp, ep=p.ep, ranks_per_node=p.ranks_per_node,
                        timeout_s=p.timeout_s)
    if world > 1:
        from datetime import timedelta
        store = _join(rank, world, p.timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=p.timeout_s))
        dims.build_groups(device.type)
    return dims, device


def _join(rank: int, world: int, timeout_s: int):
    """The store the process group forms on (torch's ``env://`` rendezvous: ``MASTER_ADDR:MASTER_PORT``,
    hosted by rank 0, or under torchrun by its agent), once every rank has reached it. Torch's own wait there
    ends in a traceback that counts the ranks missing at best; here a rank that waited ``parallel.timeout_s``
    for the others raises ``TrainingError`` naming them, or the store's address when it never answered."""
    from datetime import timedelta

    import torch.distributed as dist
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not (port or "").isdigit():
        raise ConfigError(f"rank {rank}: WORLD_SIZE={world} needs MASTER_ADDR and MASTER_PORT (the rendezvous "
                          f"address), got {host!r} and {port!r}: start the ranks with torchrun or srun "
                          "(tools/slurm/train.sbatch)")
    where = f"{host}:{port} (MASTER_ADDR:MASTER_PORT)"
    timeout = timedelta(seconds=timeout_s)
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        # as torch's env:// rendezvous builds it, except that rank 0 does not wait for the others in here
        store = dist.TCPStore(host, int(port), world, is_master=hosts, timeout=timeout, wait_for_workers=False,
                              multi_tenant=True)
    except dist.DistNetworkError as e:
        if "EADDRINUSE" in str(e):
            raise ConfigError(
                f"rank {rank}: the rendezvous address {where} is already in use, by another job on this node or a "
                "run still exiting; set MASTER_PORT to a free port (tools/slurm/train.sbatch derives it from the "
                "job id: 20000 + id % 20000)") from None
        if hosts or "timed out" not in str(e):
            raise
        raise TrainingError(
            f"rank {rank}: the rendezvous store at {where}, hosted by rank 0 (or by torchrun's agent), did not "
            f"answer within {timeout_s} s (parallel.timeout_s): rank 0 did not start, or hangs before it; see its "
            "log, and check that this host reaches that address") from None
    # one key per rank, per torchrun restart (the agent's store outlives its workers)
    joined = dist.PrefixStore(f"dsv3/joined/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    joined.set(str(rank), socket.gethostname())
    try:
        joined.wait([str(r) for r in range(world)], timeout)
    except dist.DistStoreError:
        missing = [r for r in range(world) if not joined.check([str(r)])]
        if not missing:   # they arrived just now
            return store
        raise TrainingError(
            f"rank {rank}: {_ranks(missing)} of {world} did not join the process group at {where} within "
            f"{timeout_s} s (parallel.timeout_s): not started, or hanging before it; see their logs"
        ) from None
    return store


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 1, 4-7``: sorted ranks, runs as ranges."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(a[0]) if len(a) == 1 else f"{a[0]}-{a[-1]}" for a in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _resume_step_dir(cfg, run_dir: str):
    """The step dir ``checkpoint.resume`` names, or for ``auto`` the newest complete one in the run's checkpoint
    directory, not yet verified (the trainer verifies it, and may fall back to an older one of the same run, with
    the same model config and tokenizer files); None for ``none`` or without one."""
    resume = cfg.checkpoint.resume
    if resume != "auto":
        return None if resume == "none" else Path(resume).expanduser()
    from checkpoint import CheckpointManager
    root = cfg.checkpoint.dir or Path(run_dir) / "checkpoints"
    return CheckpointManager(root, is_writer=False, rank=0, world_size=1).latest()


def _shared_run_dir(run_dir: str, dims) -> str:
    """Ranks may resolve Hydra's time-stamped run dir a second apart: everyone uses rank 0's."""
    if dims.world_size == 1:
        return run_dir
    import torch.distributed as dist
    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _shut_down_groups(dims) -> None:
    """Barrier, then destroy every process group with nothing else holding it, so each group's worker
    threads are joined now. A gloo worker that frees a finished collective's tensors after the interpreter
    began shutting down aborts the process (std::terminate: SIGABRT after a successful run)."""
    import gc

    import torch.distributed as dist
    dist.barrier()
    dims.groups.clear()
    gc.collect()          # the run's objects in reference cycles (modules, hooks) that still hold a group
    dist.destroy_process_group()


@hydra.main(version_base=None, config_path="pkg://configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    _composed()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    stops = _STOPS or StartupStops(int(os.environ.get("RANK", "0"))).install()
    try:
        try:
            # checkpoint.init_from: an HF directory's config.json is the model, its tokenizer the data's
            raw = to_object(dcfg)
            cfg = validate(apply_init_from(raw, HydraConfig.get().overrides.task,
                                           lambda: _resume_step_dir(raw, HydraConfig.get().runtime.output_dir)),
                           world_size)
        except ConfigError as e:
            _config_error(e)
        try:
            from .train import Trainer   # heavy imports after the config is known to be valid
            stops.raising()   # from here on there is something to clean up (process group, directory locks)
            dims, device = _init_distributed(cfg)
            trainer = Trainer(cfg, _shared_run_dir(HydraConfig.get().runtime.output_dir, dims), dims, device)
        except (ConfigError, ModelError) as e:   # a checkpoint, a HF directory, the data, the memory estimate
            _config_error(e, maybe_own=True)
        except TrainingError as e:                # a peer that never joined the process group
            _exit_now(f"error: {e}", EXIT_FAILED)
    except StartupInterrupted as e:   # the trainer released its directory locks on the way out
        _stop_in_startup(stops, e.signal)
    stops.finishing()   # the training loop installs its own handlers; after it, signals no longer cut closing short
    # A rank ended by a signal it cannot handle in Python (NCCL's watchdog aborts a rank whose collective timed
    # out: SIGABRT) prints every thread's Python stack first: the MoE layer or pipeline action it was in.
    faulthandler.enable(all_threads=True)
    try:
        summary = trainer.train()
    except TrainingError as e:        # one line naming rank, step, phase; no barrier that would wait out peers
        _exit_now(f"error: {e}", EXIT_FAILED)
    except (ConfigError, ModelError) as e:
        _exit_now(f"error: {e}", EXIT_CONFIG)
    except SystemExit:                # a launcher's own signal handler ended the run (submitit: requeue on USR2)
        raise
    except BaseException:             # a bug or an unexpected failure: this rank's traceback, at once
        _exit_now(f"rank {dims.rank}: training failed:\n{traceback.format_exc()}", EXIT_FAILED)
    if dims.world_size > 1:
        del trainer           # its dispatchers, optimizer and pipeline hold process groups
        _shut_down_groups(dims)
    if summary.get("stopped"):
        ignore_stops()
        sys.exit(EXIT_STOPPED)
    # Done: return (exit code 0). Launchers that run this function in their own process (Hydra's submitit
    # launcher) wait for its return value; a SystemExit here would leave them waiting for a result.


def _stop_in_startup(stops: StartupStops, name: str) -> NoReturn:
    """A stop signal before the first step (the trainer, if it got that far, released its directory locks): one
    line, the process group destroyed (no barrier: the peers got the same signal, or torchrun ends them), exit 75
    (EX_TEMPFAIL: the sbatch script requeues). Ended by ``python -m trainer.torchrun`` because another worker
    failed (``closed_by_launcher``): no line, exit 128 + the signal's number."""
    stops.finishing()   # a second signal now changes nothing
    closed = closed_by_launcher()   # ended by the launcher because another worker failed: its line is the one
    if not closed:
        print(stopped_in_startup(stops.rank, name), file=sys.stderr, flush=True)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    # Not sys.exit: the signal may have cut an import short (datasets, tokenizers, a CUDA library), and the
    # interpreter's shutdown could then run a half-initialised extension's finalisers.
    os._exit(128 + signal.Signals[name] if closed else EXIT_STOPPED)


def _config_error(e: ConfigError, maybe_own: bool = False) -> NoReturn:
    """Exit 2 with one line, printed once. An error in the config itself (keys, values, layout for this world
    size) is the same on every rank: rank 0 says it, the others leave in silence. One found while building
    (``maybe_own``: a checkpoint, the data, the memory estimate) is usually the same everywhere too, but may
    be this rank's own (a file its node lacks): it says its own if it is still running. A rank other than 0
    always waits a moment first, and torchrun or srun --kill-on-bad-exit ends it meanwhile when rank 0 has
    exited 2: a launcher that ends the job at the first failed rank would otherwise kill rank 0 before it
    printed (seen under load, when rank 1 got there first)."""
    rank0 = os.environ.get("RANK", "0") == "0"
    leave_on_signal(EXIT_CONFIG)   # torchrun's SIGTERM while we wait: leave with this error's code, in silence
    if not rank0:
        time.sleep(3)
    if rank0 or maybe_own:
        print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG)


def _check_cli_keys(args: list[str]) -> None:
    """Every override parses, names a schema key (``+`` or not, and the keys inside a dict or list value) with a
    value of its type, or a config group and one of its options, before Hydra composes anything: a mistake is one
    line and exit 2 (Hydra's own answer to ``train.max_step=3`` or ``train.max_steps=abc`` is six lines and exit 1,
    and to ``+train.max_step=3`` a key nobody reads)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    candidates = [a for a in args if not a.startswith("-") and ("=" in a or a.startswith("~"))]
    parser = OverridesParser.create()
    overrides = []
    for arg in candidates:   # one at a time, to name the one that does not parse
        try:
            overrides += parser.parse_overrides([arg])
        except OverrideParseException as e:
            _config_error(ConfigError(
                f"{arg}: not a valid override: {str(e).splitlines()[0]} (quote a value with brackets, braces, commas "
                "or spaces: key='...'; syntax: https://hydra.cc/docs/advanced/override_grammar/basic)"))
    configs = resources.files("configs")
    groups = tuple(sorted(p.name for p in configs.iterdir() if p.is_dir() and p.name[0] != "_"))
    own_search_path = any(a.startswith(("--config-dir", "-cd", "--config-path", "-cp")) for a in args)
    for o in overrides:
        key = o.key_or_group
        if o.package is not None or key.split(".")[0].split("/")[0] == "hydra":
            continue
        try:
            if key in groups:
                if not own_search_path and isinstance(o.value(), str) and not o.is_delete():
                    _check_option(key, o.value(), configs / key)
                continue
            if o.is_sweep_override() or o.is_delete():
                check_key(key, top_level_extra=groups)
            else:
                check_key(key, o.value(), top_level_extra=groups)
        except ConfigError as e:
            _config_error(e)


def _check_option(group: str, option: str, folder) -> None:
    """``model=v3_smal``: ``ConfigError`` naming the group's options unless ``configs/<group>/<option>.yaml`` exists."""
    options = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
    if option not in options:
        close = difflib.get_close_matches(option, options, n=1)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        raise ConfigError(f"{group}={option}: configs/{group}/ has no {option}.yaml; {hint}the options are "
                          f"{', '.join(options)}")


def _main() -> None:
    """``main()``, with an error Hydra meets while composing the config that ``_check_cli_keys`` could not see
    coming (a bad value in an experiment file, a config directory of the user's) as one line and exit 2 instead of
    Hydra's block and exit 1. Hydra reports such errors itself unless HYDRA_FULL_ERROR is set: it is set here for
    the composition only (``main`` removes it), so that the run itself keeps Hydra's reporting. A user's own
    HYDRA_FULL_ERROR=1 keeps Hydra's traceback, and so does a multirun (``-m``: its launcher's jobs, e.g. SLURM
    jobs, would inherit the variable)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or {"-m", "--multirun"} & set(sys.argv[1:]):
        main()
        return
    global _composing
    os.environ["HYDRA_FULL_ERROR"], _composing = "1", True
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        _config_error(ConfigError(_hydra_message(e)))
    finally:
        _composed()


_composing = False   # _main set HYDRA_FULL_ERROR for the composition; main's first line removes it


def _composed() -> None:
    global _composing
    if _composing:
        os.environ.pop("HYDRA_FULL_ERROR", None)
        _composing = False


def _hydra_message(e: Exception) -> str:
    """Hydra's or OmegaConf's error as one line: the key and OmegaConf's reason for a bad value, Hydra's text with
    its lists folded (``Available options in 'exp': tiny, v3_small``) and without its search path otherwise."""
    from omegaconf.errors import OmegaConfBaseException

    from configs.schema import omegaconf_message
    cause = e if isinstance(e, OmegaConfBaseException) else e.__cause__ or e.__context__
    if isinstance(cause, OmegaConfBaseException):
        where = "" if cause is e else f" ({str(e).splitlines()[0].rstrip(':')})"
        return omegaconf_message(cause) + where
    parts: list[str] = []
    for line in str(e).split("Config search path:")[0].splitlines():
        if not line.strip():
            continue
        if line.startswith(("\t", " ")) and parts and parts[-1].endswith((":", ",")):
            parts[-1] += " " + line.strip() + ","   # an item of the list the line before opened
        else:
            parts.append(line.strip())
    return "; ".join(p.rstrip(",") for p in parts)


def _exit_now(message: str, code: int) -> None:
    """Print and leave without waiting for peers (a barrier or process-group teardown could block until
    their timeout). torchrun then stops the other ranks; under srun they fail at their next collective."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    _check_cli_keys(sys.argv[1:])
    _main()
