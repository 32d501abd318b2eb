"""SLURM launch on a real scheduler: a one-node cluster on loopback (Debian's slurmctld/slurmd/munge,
config in a temp dir) runs tools/slurm/train.sbatch with 2 ranks (srun tasks, and srun + torchrun),
survives a requeue by resuming from its checkpoint, and takes Hydra submitit sweeps. The daemons are
stopped by PID when the module's tests end (and get SIGTERM if pytest dies: PDEATHSIG).

Installs the packages with apt-get when they are missing; skips only where that is impossible."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.slurm import local_cluster as lc

from .trainer_utils import ROOT, read_jsonl

SBATCH = ROOT / "tools" / "slurm" / "train.sbatch"
COMMON = ["+exp=tiny", "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=64",
          "train.eval_batches=1", "train.eval_every=0", "logging.wandb.mode=disabled", "logging.progress=false"]
EP2 = ["parallel.ep=2", "parallel.ranks_per_node=1"]   # two ranks as two "nodes": tokens cross nodes


def _ensure_slurm() -> None:
    if not lc.missing_binaries():
        if os.geteuid() != 0:
            pytest.skip("SLURM is installed but the one-node test cluster needs root (slurmd, munged as munge)")
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"apt-get is unavailable: cannot install {' '.join(lc.PACKAGES)} (missing {lc.missing_binaries()})")
    if os.geteuid() != 0:
        pytest.skip(f"not root: cannot apt-get install {' '.join(lc.PACKAGES)}")
    lc.install()
    assert not lc.missing_binaries(), f"apt-get installed {lc.PACKAGES} but {lc.missing_binaries()} are missing"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    _ensure_slurm()
    c = lc.LocalCluster(tmp_path_factory.mktemp("slurm"))
    request.addfinalizer(lambda: _stop_and_check(c))   # registered first: runs even if start() is interrupted
    c.start()
    return c


def _stop_and_check(c: lc.LocalCluster) -> None:
    pids = [p.pid for p in c.procs.values()]
    c.stop()
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and b"Z" not in _state(pid)]
    assert not alive, f"daemons still running after stop(): {alive}"
    assert not c._job_processes(), "job processes of the test cluster still running"


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1].split()[0]
    except OSError:
        return b"Z"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm-data-cache")


def job_env(**extra) -> dict:
    return {"PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
            **{k: str(v) for k, v in extra.items()}}


def wait_until(ok, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if ok():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def explain(cluster, info: dict, run: Path) -> str:
    out = Path(info.get("StdOut", ""))
    text = out.read_text(errors="replace")[-3000:] if out.is_file() else "(no job output)"
    for log in sorted((run / "logs").glob("*.log")):
        text += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-3000:]
    return f"{info.get('JobState')} {info.get('ExitCode')}\n{text}\n{cluster.logs()}"


def test_sbatch_two_ranks_requeue_resumes(cluster, tmp_path, cache):
    """Acceptance: the sbatch job runs 2 ranks (srun tasks), writes metrics, and a requeue resumes it."""
    run = tmp_path / "run"
    job = cluster.sbatch(["--ntasks=2", "--job-name=dsv3-ci", str(SBATCH), *COMMON, *EP2, "train.max_steps=16",
                          "checkpoint.every=2", f"data.cache_dir={cache}"], env=job_env(RUN_DIR=run), cwd=tmp_path)
    wait_until(lambda: (run / "checkpoints" / "step_00000002").is_dir()
               or cluster.job_info(job).get("JobState") in lc.TERMINAL, 300, "the first checkpoint")
    # The time-limit warning (#SBATCH --signal=B:USR1@300): the script's trap requeues the job, which
    # restarts with the same job id, hence the same RUN_DIR, and checkpoint.resume=auto continues.
    try:
        cluster.signal_batch(job, "USR1")
        cluster.wait_restarted(job)
        via_trap = True
    except lc.ClusterError:
        if cluster.job_info(job).get("JobState") != "COMPLETED":
            raise
        cluster.requeue(job)   # a very fast machine finished first: requeue the finished job instead
        via_trap = False
    info = cluster.wait(job, 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", explain(cluster, info, run)
    assert info["Restarts"] == "1" and info["NumTasks"] == "2"

    last = {m["step"]: m for m in read_jsonl(run / "metrics.jsonl")}   # steps after the checkpoint appear twice
    assert sorted(last) == list(range(1, 17))
    assert all(m["ep_cross_node_tokens"] > 0 for m in last.values())   # both ranks exchanged tokens
    assert len(last[16]["mem_peak_gb_per_rank"]) == 2
    logs = sorted((run / "logs").glob(f"{job}-rank*.log"))
    assert [p.name for p in logs] == [f"{job}-rank0.log", f"{job}-rank1.log"]
    rank0 = logs[0].read_text(errors="replace")
    assert "resumed from" in rank0 and "done: step 16/16" in rank0
    job_log = (tmp_path / f"dsv3-ci-{job}.out").read_text()
    assert "restart 1" in job_log and ("USR1: time limit near; requeueing" in job_log or not via_trap)
    assert "1 node(s) x 2 rank(s) = 2" in job_log
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000016").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]


def test_sbatch_torchrun_launcher(cluster, tmp_path, cache):
    """LAUNCHER=torchrun: one srun task per node running torchrun with c10d rendezvous."""
    run = tmp_path / "run"
    job = cluster.sbatch(["--ntasks=1", "--cpus-per-task=2", "--job-name=dsv3-trun", str(SBATCH), *COMMON, *EP2,
                          "train.max_steps=3", f"data.cache_dir={cache}"],
                         env=job_env(RUN_DIR=run, LAUNCHER="torchrun", NPROC_PER_NODE=2), cwd=tmp_path)
    info = cluster.wait(job, 300)
    assert info["JobState"] == "COMPLETED", explain(cluster, info, run)
    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3] and len(lines[-1]["mem_peak_gb_per_rank"]) == 2
    assert (run / "logs" / f"{job}-node0.log").is_file()


def _multirun(cluster, tmp_path, *overrides) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           "hydra.launcher.timeout_min=20", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**cluster.env, **job_env()})


def test_submitit_slurm_two_point_sweep(cluster, tmp_path, cache):
    """Acceptance: hydra/launcher=submitit_slurm submits a 2-point sweep to the cluster; both jobs train."""
    proc = _multirun(cluster, tmp_path, "hydra/launcher=submitit_slurm", *COMMON, "train.max_steps=2",
                     "checkpoint.save_final=false", f"data.cache_dir={cache}", "train.seed=0,1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [read_jsonl(tmp_path / "sweep" / str(i) / "metrics.jsonl") for i in (0, 1)]
    assert [[m["step"] for m in r] for r in runs] == [[1, 2], [1, 2]]
    assert runs[0][0]["loss"] != runs[1][0]["loss"]                 # seeds 0 and 1
    assert len(list((tmp_path / "sweep" / ".submitit").glob("*_*/*_0_log.out"))) == 2   # two SLURM array tasks


def test_slurm_launcher_config_runs_two_ranks_per_job(cluster, tmp_path, cache):
    """hydra/launcher=slurm (configs/hydra/launcher/slurm.yaml): several tasks per job; the SlurmTorchEnv
    callback turns them into one 2-rank torch.distributed job."""
    proc = _multirun(cluster, tmp_path, "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2",
                     "hydra.launcher.gpus_per_node=null", *COMMON, *EP2, "train.max_steps=2",
                     "checkpoint.save_final=false", f"data.cache_dir={cache}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = read_jsonl(tmp_path / "sweep" / "0" / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[-1]["ep_cross_node_tokens"] > 0 and len(lines[-1]["mem_peak_gb_per_rank"]) == 2
