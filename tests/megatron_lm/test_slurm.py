"""The SLURM launcher on a throwaway single-node cluster started by the test (opt-in, CPU).

Needs ``slurmctld``, ``slurmd``, ``munged`` (Debian: ``apt-get install slurm-wlm munge``), a
Megatron-LM checkout in ``MEGATRON_LM_DIR`` and ``MECHMON_SLOW=1``; Megatron-LM's extra packages
may live in ``MECHMON_E2E_PYTHONPATH``. The daemons run from a temporary directory with their own
slurm.conf and munge key, and are stopped by pid; no system configuration is touched.

The job runs pretrain_gpt_mechmon.sbatch (2 CPU ranks, the default MECHMON_LAUNCH=run on an
unmodified copy of the checkout) with a drill at iteration 20 and
checkpoint-and-abort: it must end with exit code 42 and must NOT be requeued.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from checkout_utils import copy_checkout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")
MISSING = [d for d in DAEMONS if shutil.which(d) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"SLURM/munge not installed ({', '.join(MISSING)} missing): apt-get install slurm-wlm munge",
    ),
    pytest.mark.skipif(not MEGATRON_LM_DIR, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the throwaway cluster runs its daemons as root"),
]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


@pytest.fixture
def cluster(tmp_path):
    """munged + slurmctld + slurmd on this host, all state under tmp_path; stopped by pid."""
    host = socket.gethostname().split(".")[0]
    base = tmp_path / "slurm"
    for sub in ("state", "spool", "log", "run", "munge"):
        (base / sub).mkdir(parents=True)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = base / "munge" / "munge.socket"
    conf = base / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=mechmontest", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
                "AuthType=auth/munge", "CredType=cred/munge", "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
                "ReturnToService=2", "MpiDefault=none", "JobRequeue=1", "MinJobAge=600",
                f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
                f"StateSaveLocation={base / 'state'}", f"SlurmdSpoolDir={base / 'spool'}",
                f"SlurmctldLogFile={base / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={base / 'log' / 'slurmd.log'}",
                f"SlurmctldPidFile={base / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={base / 'run' / 'slurmd.pid'}",
                f"NodeName={host} CPUs={os.cpu_count()} RealMemory=2000 State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs = []

    def start(cmd):
        log = open(base / "log" / f"{os.path.basename(cmd[0])}.out", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    # Our own munged (root, --force: the temporary directory is private) on our own socket;
    # slurm finds it through AuthInfo.
    conf.write_text(conf.read_text() + f"AuthInfo=socket={sock}\n")
    start(
        [
            "munged",
            "-F",
            "--force",
            "--key-file",
            str(key),
            "--socket",
            str(sock),
            "--pid-file",
            str(base / "munge" / "munged.pid"),
            "--log-file",
            str(base / "munge" / "munged.log"),
            "--seed-file",
            str(base / "munge" / "munged.seed"),
        ]
    )
    _wait_for(sock.exists, 20, "munged socket")
    start(["slurmctld", "-D", "-f", str(conf)])
    start(["slurmd", "-D", "-f", str(conf)])
    try:
        _wait_for(
            lambda: (
                subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip()
                in ("idle", "idle*")
            ),
            60,
            "idle node",
        )
        yield env, base
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sbatch_abort_exits_42_and_is_not_requeued(cluster, tmp_path):
    env, base = cluster
    checkout = copy_checkout(MEGATRON_LM_DIR, str(tmp_path / "Megatron-LM"))  # unmodified: MECHMON_LAUNCH=run
    run_dir = tmp_path / "run"
    extra = [p for p in os.environ.get("MECHMON_E2E_PYTHONPATH", "").split(os.pathsep) if p]
    job_env = dict(
        env, MEGATRON_LM_DIR=checkout, MECHMON_DIR=REPO, RUN_DIR=str(run_dir), TRAIN_ITERS="30",
        MECHMON_INTERVAL="5", MECHMON_DELTA="5", NPROC_PER_NODE="2", PYTHON=sys.executable,
        PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"], PYTHONPATH=os.pathsep.join(extra),
    )
    out = tmp_path / "job.out"
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--output={out}",
            "--time=30",
            os.path.join(REPO, "examples", "pretrain_scripts", "pretrain_gpt_mechmon.sbatch"),
            "--mechmon-drill-at",
            "20",
        ],
        env=job_env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]

    def job_info() -> str:
        return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout

    _wait_for(
        lambda: re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)", job_info()) is not None,
        900,
        f"job {job} end",
    )
    info = job_info()
    log = out.read_text() if out.exists() else ""
    assert "JobState=FAILED" in info and "ExitCode=42:0" in info, info + log[-3000:]
    assert "Restarts=0" in info and "not requeued" in log, info + log[-3000:]
    alert = json.load(open(run_dir / "checkpoints" / "iter_0000020" / "mechmon_alert.json"))
    assert alert["iteration"] == 20 and alert["exit_code"] == 42
