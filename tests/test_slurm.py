"""SLURM launch on a real scheduler: a one-node cluster on loopback (Debian's slurmctld/slurmd/munge,
config in a temp dir) runs tools/slurm/train.sbatch with 2 ranks (srun tasks, and srun + torchrun). SIGUSR1
mid-run (what ``#SBATCH --signal=USR1@<s>`` sends before the time limit) makes the ranks save and exit 75,
the script requeues the job, and the rerun resumes to the same losses as an uninterrupted run, one
metrics line per step, in the same W&B run. Hydra submitit sweeps run too. The daemons are stopped by PID
when the module's tests end (and get SIGTERM if pytest dies: PDEATHSIG).

Installs the packages with apt-get when they are missing; skips only where that is impossible."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import local_cluster as lc
from tools.slurm.job_watch import _task_ids
from trainer.metrics import RUN_ID_FILE
from trainer.wandb_log import read_offline_run

from .trainer_utils import ROOT, assert_losses_match, read_jsonl, run_torchrun

SBATCH = ROOT / "tools" / "slurm" / "train.sbatch"
SHAPE = ["train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0"]
COMMON = ["+exp=tiny", *SHAPE, "logging.wandb.mode=disabled", "logging.progress=false"]
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
    c = lc.LocalCluster(tmp_path_factory.mktemp("slurm"), first_job_id=first_job_id())
    request.addfinalizer(lambda: _stop_and_check(c))   # registered first: runs even if start() is interrupted
    c.start()
    return c


def first_job_id() -> int:
    """Each pytest-xdist worker starts its own cluster: a block of job ids per worker, so the rendezvous
    ports derived from them (train.sbatch: 20000 + id % 20000) differ. Ids below 12768 map below 32768,
    the start of Linux's ephemeral range, where no free-port pick of another test can land."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 1 + 1000 * int(worker.removeprefix("gw"))


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


def metric_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def signal_mid_run(cluster, job: int, run: Path, after_steps: int, send) -> None:
    """Once rank 0 has logged ``after_steps`` steps, ``send`` the stop signal; then wait for the restart."""
    wait_until(lambda: metric_lines(run / "metrics.jsonl") >= after_steps
               or cluster.job_info(job).get("JobState") in lc.TERMINAL, 300, f"step {after_steps}")
    assert cluster.job_info(job).get("JobState") == "RUNNING", "the job ended before it could be signalled"
    send(job, "USR1")
    cluster.wait_restarted(job, 180)


def resumed_step(rank0_log: str) -> int:
    found = re.findall(r"resumed from \S+/step_(\d{8}) at step (\d+)", rank0_log)
    assert len(found) == 1, rank0_log[-3000:]
    assert int(found[0][0]) == int(found[0][1])
    return int(found[0][1])


@pytest.mark.slow
def test_sbatch_usr1_checkpoints_requeues_and_resumes_like_uninterrupted(cluster, tmp_path, cache):
    """Acceptance: 2 ranks (srun tasks). SIGUSR1 to the job's steps mid-run, as `#SBATCH --signal=USR1@300`
    sends it 300 s before the time limit: the ranks finish the step, save a checkpoint (no periodic ones
    here) and exit 75; the script requeues the job; the rerun (same job id, same RUN_DIR) resumes from that
    checkpoint. metrics.jsonl then holds each step once, the losses of the two runs together equal an
    uninterrupted run's, and W&B (offline) got both runs under one run id."""
    run, steps = tmp_path / "run", 16
    job = cluster.sbatch(["--ntasks=2", "--job-name=dsv3-ci", str(SBATCH), *COMMON, *EP2, f"train.max_steps={steps}",
                          "checkpoint.every=0", "logging.wandb.mode=offline", f"data.cache_dir={cache}"],
                         env=job_env(RUN_DIR=run), cwd=tmp_path)
    signal_mid_run(cluster, job, run, 2, cluster.signal_steps)
    info = cluster.wait(job, 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", explain(cluster, info, run)
    assert info["Restarts"] == "1" and info["NumTasks"] == "2"

    job_log = (tmp_path / f"dsv3-ci-{job}.out").read_text()
    assert "rank exit codes: rank0=75 rank1=75" in job_log and f"requeueing job {job}" in job_log, job_log
    assert "rank exit codes: rank0=0 rank1=0" in job_log and "restart 1" in job_log, job_log
    assert "1 node(s) x 2 rank(s) = 2" in job_log
    logs = sorted((run / "logs").glob(f"{job}-rank*.log"))
    assert [p.name for p in logs] == [f"{job}-rank0.log", f"{job}-rank1.log"]
    rank0 = logs[0].read_text(errors="replace")
    stop = resumed_step(rank0)
    assert 2 <= stop < steps and f"stopping at step {stop} on request (SIGUSR1)" in rank0, rank0[-3000:]
    assert "SIGUSR1 received" in logs[1].read_text(errors="replace")   # every rank got the signal itself
    assert "done: step 16/16" in rank0
    assert sorted(p.name for p in (run / "checkpoints" / f"step_{stop:08d}").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]

    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, steps + 1))   # one line per step across both runs
    assert all(m["ep_cross_node_tokens"] > 0 for m in lines) and len(lines[-1]["mem_peak_gb_per_rank"]) == 2
    straight = run_torchrun(tmp_path, "straight", 2, *SHAPE, *EP2, "checkpoint.every=0", f"data.cache_dir={cache}",
                            steps=steps)
    assert_losses_match(lines, straight, rel=1e-5)

    # W&B: the requeued run continued the same run id (offline: one dir per start, same id).
    wandb_runs = sorted((run / "wandb").glob("offline-run-*"), key=lambda p: p.name)
    assert len(wandb_runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in wandb_runs}) == 1, wandb_runs
    run_id = wandb_runs[0].name.rsplit("-", 1)[1]
    assert (run / "checkpoints" / f"step_{stop:08d}" / RUN_ID_FILE).read_text().strip() == run_id
    histories = [[row["_step"] for row in read_offline_run(p)[0] if "train/loss" in row] for p in wandb_runs]
    assert histories == [list(range(1, stop + 1)), list(range(stop + 1, steps + 1))]


def test_sbatch_torchrun_launcher_usr1_to_batch_script(cluster, tmp_path, cache):
    """LAUNCHER=torchrun: one srun task per node running torchrun with c10d rendezvous. SIGUSR1 to the batch
    script (as `--signal=B:USR1@...` would send it) is passed on to the steps; torchrun ignores it (it would
    die of it otherwise), its workers save and exit 75, the job is requeued and resumes."""
    run, steps = tmp_path / "run", 16   # the signal travels batch script -> srun -> torchrun -> workers: room for it
    job = cluster.sbatch(["--ntasks=1", "--cpus-per-task=2", "--job-name=dsv3-trun", str(SBATCH), *COMMON, *EP2,
                          f"train.max_steps={steps}", "checkpoint.every=0", f"data.cache_dir={cache}"],
                         env=job_env(RUN_DIR=run, LAUNCHER="torchrun", NPROC_PER_NODE=2), cwd=tmp_path)
    signal_mid_run(cluster, job, run, 1, cluster.signal_batch)
    info = cluster.wait(job, 300)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", explain(cluster, info, run)
    assert info["Restarts"] == "1"
    job_log = (tmp_path / f"dsv3-trun-{job}.out").read_text()
    assert "USR1 to the batch script: passing it on" in job_log and f"requeueing job {job}" in job_log, job_log
    assert "rank exit codes: rank0=75 rank1=75" in job_log, job_log
    node_log = (run / "logs" / f"{job}-node0.log").read_text(errors="replace")
    stop = resumed_step(node_log)
    assert 1 <= stop < steps and node_log.count("SIGUSR1 received") == 2, node_log[-3000:]   # once per worker
    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, steps + 1)) and len(lines[-1]["mem_peak_gb_per_rank"]) == 2


def test_sbatch_cancel_saves_and_is_not_requeued(cluster, tmp_path, cache):
    """scancel (also what the time limit and a preemption send): the ranks get SIGTERM, save at the step
    boundary and exit 75, but the script does not requeue a job that is being terminated."""
    run = tmp_path / "run"
    job = cluster.sbatch(["--ntasks=2", "--job-name=dsv3-cancel", str(SBATCH), *COMMON, *EP2, "train.max_steps=40",
                          "checkpoint.every=0", f"data.cache_dir={cache}"], env=job_env(RUN_DIR=run), cwd=tmp_path)
    assert first_job_id() <= job < first_job_id() + 1000, f"job {job}: the cluster ignored FirstJobId"
    wait_until(lambda: metric_lines(run / "metrics.jsonl") >= 1
               or cluster.job_info(job).get("JobState") in lc.TERMINAL, 300, "step 1")
    r = cluster._run(["scancel", str(job)])
    assert r.returncode == 0, r.stderr
    info = cluster.wait(job, 120)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", explain(cluster, info, run)
    job_log = (tmp_path / f"dsv3-cancel-{job}.out").read_text()
    assert "rank exit codes: rank0=75 rank1=75" in job_log and "not requeued: the job was terminated" in job_log, \
        job_log
    rank0 = (run / "logs" / f"{job}-rank0.log").read_text(errors="replace")
    found = re.search(r"stopping at step (\d+) on request \(SIGTERM\)", rank0)
    assert found, rank0[-3000:]
    stop = int(found.group(1))
    assert (run / "checkpoints" / f"step_{stop:08d}" / "manifest.json").is_file()
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, stop + 1))


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


def test_slurm_launcher_defaults_run_on_a_cpu_partition(cluster, tmp_path, cache):
    """hydra/launcher=slurm with its defaults (one task, no GPU request: a CPU partition refuses
    --gpus-per-node with "Invalid generic resource") submits and trains."""
    proc = _multirun(cluster, tmp_path, "hydra/launcher=slurm", *COMMON, "train.max_steps=2",
                     "checkpoint.save_final=false", f"data.cache_dir={cache}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(tmp_path / "sweep" / "0" / "metrics.jsonl")] == [1, 2]
    scripts = list((tmp_path / "sweep" / ".submitit").glob("*/*_submission.sh"))
    assert len(scripts) == 1 and "gpu" not in scripts[0].read_text().lower()


def test_slurm_launcher_reports_a_job_that_fails_at_once(cluster, tmp_path, cache):
    """Acceptance: a 2-rank job that exits 2 on a config error within its first seconds. The cluster has no
    accounting (sacct fails) and the job leaves no result file: the launcher learns the end from the
    controller, prints the job's error (rank 0's only) with state, exit code and log, and exits 2 within a
    minute (the stock launcher waited until an outside timeout)."""
    start = time.monotonic()
    proc = _multirun(cluster, tmp_path, "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", *COMMON, *EP2,
                     "optim.eps=0", f"data.cache_dir={cache}")
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert took < 60, f"{took:.0f}s"
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"error: sweep job #0: SLURM job \d+ FAILED, exit code 2: optim\.eps: must "
                                          r"be finite and > 0, got 0; log \S+_0_log\.err", err[0]), proc.stderr
    logs = sorted((tmp_path / "sweep" / ".submitit").glob("*/*_log.err"))
    assert [p.read_text().count("error: optim.eps") for p in logs] == [1, 0]   # rank 0 says it, rank 1 does not


def test_sbatch_torchrun_config_error_is_one_line(cluster, tmp_path, cache):
    """LAUNCHER=torchrun: a config error leaves one line in the node log (python -m trainer.torchrun: no
    ChildFailedError traceback) and the job fails with exit code 2; the run dir links the job's own log."""
    run = tmp_path / "run"
    job = cluster.sbatch(["--ntasks=1", "--cpus-per-task=2", "--job-name=dsv3-bad", str(SBATCH), *COMMON, *EP2,
                          "optim.eps=0", f"data.cache_dir={cache}"],
                         env=job_env(RUN_DIR=run, LAUNCHER="torchrun", NPROC_PER_NODE=2), cwd=tmp_path)
    info = cluster.wait(job, 120)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", explain(cluster, info, run)
    node_log = (run / "logs" / f"{job}-node0.log").read_text(errors="replace")
    assert node_log.strip().splitlines() == ["error: optim.eps: must be finite and > 0, got 0"], node_log
    job_log = (run / "logs" / f"{job}.out").read_text()   # the link to <submit dir>/dsv3-bad-<job>.out
    assert (tmp_path / f"dsv3-bad-{job}.out").read_text() == job_log
    # rank 1 reached the same config error (2, in silence), or was still starting when the launcher ended it
    # (128 + SIGTERM, in silence: no stop to resume from)
    assert f"logs {run}/logs/{job}-node*.log" in job_log and any(
        f"rank exit codes: rank0=2 rank1={code}\n" in job_log for code in (2, 128 + signal.SIGTERM)), job_log


def test_array_task_ids_as_the_controller_prints_them():
    assert _task_ids("3") == [3] and _task_ids("0-2") == [0, 1, 2] and _task_ids("0,2-3%2") == [0, 2, 3]
