"""The SLURM launcher (examples/slurm/launch.sh + node.sh) on the tiny CPU config.

- node.sh composes torchrun's static rendezvous from SLURM's variables (dry run; no processes started), and the
  per-model sbatch scripts pick the recipe of ALGORITHM and turn the launcher's knobs into trainer arguments.
- launch.sh end to end with a stand-in `srun` (runs the task as node 0 of 1) and `scontrol` (records its
  arguments): the real torchrun + trainer start, SIGUSR1 to the batch script makes the trainer checkpoint after the
  current step and exit 0, and the script asks SLURM to requeue the job.
- Opt-in (MEGATRON_GTPO_SLURM_TEST=1, about 2-3 minutes on 2 cores): a real single-node SLURM (munged, slurmctld,
  slurmd from Debian's packages, installed with apt-get when missing; all state in a temporary directory, daemons
  stopped afterwards) runs the real sbatch launcher. Pre-empted with `scancel --signal=USR1 --batch` after its first
  step, the job checkpoints, requeues itself and resumes to the last step; metrics.jsonl holds every step once.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from distributed_harness import free_port

pytestmark = pytest.mark.slow  # a real SLURM, training runs under it

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LAUNCH = os.path.join(REPO, "examples", "slurm", "launch.sh")
NODE = os.path.join(REPO, "examples", "slurm", "node.sh")
TINY_OVERRIDES = "--set warm_start.steps=0 --set data.prompts_per_step=8 --set checkpoint.save_every=0 " \
                 "--set logging.tensorboard=false --set logging.progress_bar=false"


def _node_dry_run(**env):
    base = {"PATH": os.environ["PATH"], "PYTHON": sys.executable, "PYTHONPATH": REPO, "DRY_RUN": "1"}
    return subprocess.run(["bash", NODE, "--config", "examples/cpu_demo.yaml", "--set", "steps=2"],
                          env={**base, **env}, capture_output=True, text=True, timeout=120, cwd=REPO)


def test_node_script_builds_the_rendezvous_from_slurm_variables():
    res = _node_dry_run(SLURM_NNODES="4", SLURM_NODEID="2", SLURM_JOB_NODELIST="gpu[017-018,020],gpu100",
                        NPROC_PER_NODE="8", MASTER_PORT="23456")
    assert res.returncode == 0, res.stderr
    command = res.stdout.strip().splitlines()[-1].split()
    assert command[:3] == [sys.executable, "-m", "megatron_gtpo.launch"]  # torchrun, ending as the commands do
    for arg in ("--nnodes=4", "--node_rank=2", "--nproc_per_node=8", "--master_addr=gpu017", "--master_port=23456"):
        assert arg in command
    assert command[command.index("-m", 3):] == ["-m", "megatron_gtpo.train", "--config", "examples/cpu_demo.yaml",
                                                "--set", "steps=2"]
    # The step's node list wins over the job's; an explicit MASTER_ADDR wins over both.
    res = _node_dry_run(SLURM_NNODES="2", SLURM_NODEID="0", SLURM_JOB_NODELIST="a[1-9]", SLURM_STEP_NODELIST="b7,b8")
    assert "--master_addr=b7" in res.stdout
    res = _node_dry_run(SLURM_NNODES="2", SLURM_NODEID="0", SLURM_JOB_NODELIST="a[1-9]", MASTER_ADDR="10.0.0.5")
    assert "--master_addr=10.0.0.5" in res.stdout
    res = _node_dry_run(SLURM_NNODES="2", SLURM_JOB_NODELIST="a1")
    assert res.returncode != 0 and "SLURM_NODEID is not set" in res.stderr


def _stand_in_slurm_commands(bin_dir, record):
    """`srun` that runs its command as node 0 of 1 (options dropped), `scontrol` that appends its arguments to
    `record`: enough to run launch.sh outside SLURM."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  'SLURM_NODEID=0 SLURM_NNODES=1 exec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {record}\n')
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("script,algorithm", [("qwen2.5-7b.sbatch", "gtpo"), ("qwen2.5-7b.sbatch", "grpo_s"),
                                              ("qwen2.5-7b.sbatch", "dapo"), ("qwen2.5-32b.sbatch", "gtpo"),
                                              ("qwen2.5-32b.sbatch", "grpo_s"), ("qwen2.5-32b.sbatch", "dapo"),
                                              ("qwen3-30b-a3b.sbatch", "gtpo")])
def test_per_model_scripts_pick_the_recipe_and_pass_the_knobs(tmp_path, script, algorithm):
    _stand_in_slurm_commands(tmp_path / "bin", tmp_path / "scontrol.log")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NAME="t",
               SLURM_JOB_NODELIST="n[3-4]", SLURM_SUBMIT_DIR=REPO, PYTHON=sys.executable, DRY_RUN="1",
               ALGORITHM=algorithm, MODEL_DIR="/ckpt/mg", DATA_PATH="/data/x.jsonl", RUN_DIR="/runs/r",
               EXTRA_ARGS="--set steps=3 --set optim.lr=2e-6")
    res = subprocess.run(["bash", os.path.join(REPO, "examples", "slurm", script)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    config = f"examples/{script.removesuffix('.sbatch')}-{algorithm}.yaml"
    assert os.path.isfile(os.path.join(REPO, config))
    command = res.stdout.strip().splitlines()[-1]
    for part in ("--nproc_per_node=8", "--master_addr=n3", "--master_port=20077", f"--config {config}",
                 "--set logging.output_dir=/runs/r", "--set model.load=/ckpt/mg --set model.hf_dir=null",
                 "--set data.path=/data/x.jsonl", "--set steps=3 --set optim.lr=2e-6"):
        assert part in command, (part, command)
    assert not (tmp_path / "scontrol.log").exists()  # no stop was requested: no requeue


@pytest.mark.parametrize("env,status,expected", [
    ({}, 0, ["dry run of examples/slurm/qwen2.5-32b.sbatch without SLURM: 4 node(s) x 8 GPUs, config "
             "examples/qwen2.5-32b-gtpo.yaml", "qwen2.5-32b: TP=8 PP=2 DP=2 (VPP=None, SP=False), 32 GPUs of 80 GiB",
             "\nFITS"]),
    ({"NODES": "8", "ALGORITHM": "dapo", "EXTRA_ARGS": "--set algorithm.nme=grpo"}, 2,
     ["8 node(s) x 8 GPUs, config examples/qwen2.5-32b-dapo.yaml",
      "plan: error: unknown config key algorithm.nme (did you mean algorithm.name?)"]),
    ({"NODES": "3"}, 2, ["plan: error: 3 nodes x 8 GPUs are not divisible by TP x PP x CP = 8 x 2 x 1"]),
])
def test_a_dry_run_without_slurm_checks_the_config_and_plans_the_jobs_nodes(env, status, expected):
    """On a laptop: no SLURM variables, no srun; the job's settings (its recipe, EXTRA_ARGS, its #SBATCH --nodes or
    NODES) go through the config checks and the planner."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": sys.executable,
            "DRY_RUN": "1"}
    res = subprocess.run(["bash", "examples/slurm/qwen2.5-32b.sbatch"], env={**base, **env}, capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    output = res.stdout + res.stderr
    assert res.returncode == status, output[-3000:]
    for part in expected:
        assert part in output, (part, output[-3000:])


def _wait_for_metrics(path, rows: int, proc=None, timeout_s: float = 300.0, log_path=None) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines = [json.loads(line) for line in f if line.strip()]
            if len(lines) >= rows:
                return lines
        if proc is not None and proc.poll() is not None:
            log = open(log_path, encoding="utf-8", errors="replace").read()[-4000:] if log_path else ""
            raise AssertionError(f"the launcher exited ({proc.returncode}) before {rows} metrics rows:\n{log}")
        time.sleep(0.5)
    raise AssertionError(f"no {rows} metrics rows in {path} within {timeout_s:.0f}s")


def test_launcher_checkpoints_on_sigusr1_and_requeues(tmp_path):
    record = tmp_path / "scontrol.log"
    _stand_in_slurm_commands(tmp_path / "bin", record)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_JOB_NAME="test", SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=REPO,
               PYTHON=sys.executable, NPROC_PER_NODE="2", CONFIG="examples/cpu_demo.yaml", RUN_DIR=str(run_dir),
               TORCHRUN_LOG_DIR="", MASTER_PORT=str(free_port()), EXTRA_ARGS=f"--set steps=50 {TINY_OVERRIDES}")
    log_path = tmp_path / "job.out"
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(["bash", LAUNCH], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        _wait_for_metrics(run_dir / "metrics.jsonl", 1, proc, log_path=log_path)
        proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` delivers to the batch script
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log_path.read_text(errors="replace")
    assert proc.returncode == 0, out[-4000:]
    assert "received SIGUSR1: will checkpoint after this step and exit" in out
    steps = [row["step"] for row in _wait_for_metrics(run_dir / "metrics.jsonl", 1)]
    assert steps == list(range(len(steps))) and len(steps) < 50  # stopped early, after a whole step
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{len(steps):08d}"
    assert record.read_text().split() == ["requeue", "4242"]


# ---------------------------------------------------------------------------------------------- real SLURM

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def _ensure_slurm_installed():
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    install = ["apt-get", "install", "-y", *SLURM_PACKAGES]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, check=True)
        subprocess.run(install, capture_output=True, env=env, check=True)


def _slurm_conf(root, host: str) -> str:
    return "\n".join([
        "ClusterName=gtpotest", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={root}/munge/munge.sock",
        "CredType=cred/munge", f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2", "JobRequeue=1",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


class LocalSlurm:
    """munged + slurmctld + slurmd for this machine alone, every file under `root`; `stop` ends all three."""

    def __init__(self, root):
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def start(self):
        root = self.root
        for d in ("munge", "state", "spool"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        os.chmod(os.path.join(root, "munge"), 0o700)
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={root}/munge/munge.sock",
                        f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munge/munged.log",
                        f"--seed-file={root}/munge/seed"], check=True, capture_output=True)
        with open(self.conf, "w", encoding="utf-8") as f:
            f.write(_slurm_conf(root, socket.gethostname().split(".")[0]))
        subprocess.run(["slurmctld", "-f", self.conf], check=True, capture_output=True, env=self.env)
        subprocess.run(["slurmd", "-f", self.conf], check=True, capture_output=True, env=self.env)
        deadline = time.monotonic() + 60
        while self.run("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node did not become idle: {self.run('sinfo').stdout}\n{self.logs()}")
            time.sleep(0.5)

    def run(self, *cmd) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=60)

    def job_field(self, job_id: str, field: str) -> str:
        for token in self.run("scontrol", "show", "job", job_id).stdout.split():
            if token.startswith(field + "="):
                return token.split("=", 1)[1]
        return ""

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    out.append(f"--- {name}\n" + f.read()[-3000:])
        return "\n".join(out)

    def stop(self):
        if shutil.which("scancel"):
            self.run("scancel", "--user=root")
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            path = os.path.join(self.root, pid_file)
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as f:
                pid = int(f.read().strip())
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)


def _wait_for_state(cluster: LocalSlurm, job_id: str, states: set, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = cluster.job_field(job_id, "JobState")
        if state in states:
            return state
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} not in {states} after {timeout_s:.0f}s (now "
                         f"{cluster.job_field(job_id, 'JobState')})\n{cluster.logs()}")


@pytest.mark.skipif(os.environ.get("MEGATRON_GTPO_SLURM_TEST") != "1",
                    reason="opt-in, about 2-3 minutes: MEGATRON_GTPO_SLURM_TEST=1 (installs and starts a one-node "
                           "SLURM; needs root and apt-get)")
def test_real_slurm_job_preempts_requeues_and_resumes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd/munged needs root")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("SLURM is not installed and apt-get is not available to install it")
    _ensure_slurm_installed()
    cluster = LocalSlurm(str(tmp_path / "slurm"))
    steps = 20
    run_dir = tmp_path / "run"
    try:
        cluster.start()
        env = dict(cluster.env, PYTHON=sys.executable, NPROC_PER_NODE="2", CONFIG="examples/cpu_demo.yaml",
                   RUN_DIR=str(run_dir), TORCHRUN_LOG_DIR=str(tmp_path / "torchrun"),
                   EXTRA_ARGS=f"--set steps={steps} {TINY_OVERRIDES}")
        res = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/%x-%j.out", LAUNCH], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        job_id = res.stdout.strip().split(";")[0]
        _wait_for_metrics(run_dir / "metrics.jsonl", 1, timeout_s=300)
        assert cluster.run("scancel", "--signal=USR1", "--batch", job_id).returncode == 0
        # launch.sh requeues the job once the trainer has checkpointed. While the first run is being torn down the job
        # passes through transient states; once it is PENDING again (Restarts=1), SLURM holds it for ~2 minutes
        # (its BeginTime): release it now, as an administrator would, and follow the second run to its end.
        deadline = time.monotonic() + 300
        while (cluster.job_field(job_id, "Restarts"), cluster.job_field(job_id, "JobState")) != ("1", "PENDING"):
            assert time.monotonic() < deadline, f"job {job_id} was not requeued\n{cluster.logs()}"
            time.sleep(0.5)
        released = cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        assert released.returncode == 0, released.stderr
        _wait_for_state(cluster, job_id, {"RUNNING"}, 120)
        state = _wait_for_state(cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 400)
        with open(tmp_path / f"megatron-gtpo-{job_id}.out", encoding="utf-8", errors="replace") as f:
            log = f.read()
        assert state == "COMPLETED", f"{state}:\n{log[-6000:]}\n{cluster.logs()}"
    finally:
        cluster.stop()
    assert "received SIGUSR1: will checkpoint after this step and exit" in log
    assert f"requeueing job {job_id}" in log and f"job {job_id} (restart 1)" in log
    assert "resumed from" in log
    rows = _wait_for_metrics(run_dir / "metrics.jsonl", steps, timeout_s=1)
    assert [row["step"] for row in rows] == list(range(steps))
    assert os.listdir(tmp_path / "torchrun")  # per-rank logs under TORCHRUN_LOG_DIR


def test_disaggregated_job_splits_trainer_and_rollout_nodes(tmp_path):
    """disaggregated.sbatch on a stand-in 3-node allocation (DRY_RUN: commands printed, nothing started): the last
    node runs two rollout servers on 4 GPUs each, the first two train with one server address per DP replica."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: report the node list it was given, then run the task as node 0 of the trainer or on the rollout node.
    (bin_dir / "srun").write_text('#!/bin/bash\nlist=""\nwhile [[ "$1" == --* ]]; do\n'
                                  '  [[ "$1" == --nodelist=* ]] && list=${1#--nodelist=}\n  shift\ndone\n'
                                  'echo "srun on ${list:-?}"\n'
                                  'SLURMD_NODENAME=${list%%,*} SLURM_NODEID=0 SLURM_NNODES=2 exec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\nif [[ "$1 $2" == "show hostnames" ]]; then '
                                      'printf "n1\\nn2\\nn3\\n"; else echo "$@" >> '
                                      + str(tmp_path / "scontrol.log") + '; fi\n')
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable, "PYTHONPATH": REPO, "DRY_RUN": "1",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_SUBMIT_DIR": REPO, "SLURM_GPUS_ON_NODE": "8",
           "CONFIG": "examples/qwen2.5-7b-gtpo.yaml", "HF_MODEL_DIR": "/models/q7", "SERVER_TP": "4",
           "TORCHRUN_LOG_DIR": ""}
    res = subprocess.run(["bash", os.path.join(REPO, "examples", "slurm", "disaggregated.sbatch")], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "trainer nodes: n1,n2; rollout nodes: n3; servers: n3:31000 n3:31001" in out
    assert "srun on n3" in out and "srun on n1,n2" in out
    servers = [line for line in out.splitlines() if "megatron_gtpo.rollout.remote_server" in line]
    assert len(servers) == 2 and servers[0].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 ")
    assert servers[1].startswith("CUDA_VISIBLE_DEVICES=4,5,6,7 ") and "--tensor-parallel-size 4" in servers[1]
    assert "--listen n3:31001" in servers[1] and "--hf-dir /models/q7" in servers[1]
    trainer = next(line for line in out.splitlines() if "megatron_gtpo.train" in line)
    assert "--nnodes=2" in trainer
    assert "rollout.engine=vllm_remote" in trainer and "rollout.schedule.max_staleness=1" in trainer
    assert "rollout.remote.addresses=\\[n3:31000\\,n3:31001\\]" in trainer or \
        "rollout.remote.addresses=[n3:31000,n3:31001]" in trainer


def test_a_rollout_node_relaunches_a_server_that_dies_until_a_trainer_shuts_it_down(tmp_path):
    """rollout_node.sh's supervising loop, with a stand-in server (PYTHON) that dies twice (SIGKILL, then an error)
    and then is shut down (status 0): run three times at the same address, and the node ends cleanly; with
    SERVER_RESTARTS=1 it gives up after the second death, with the server's status."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$*" >> "$RUNS"\nn=$(wc -l < "$RUNS")\n'
                    '(( n == 1 )) && kill -9 $$\n(( n == 2 )) && exit 3\nexit 0\n')
    fake.chmod(0o755)
    for restarts, status, runs in (("10", 0, 3), ("1", 3, 2)):
        log = tmp_path / f"runs_{restarts}"
        env = {"PATH": os.environ["PATH"], "PYTHON": str(fake), "RUNS": str(log), "HF_MODEL_DIR": "/models/q7",
               "SERVERS_PER_NODE": "1", "ROLLOUT_ENGINE": "builtin", "SERVER_RESTARTS": restarts,
               "SLURMD_NODENAME": "n3"}
        res = subprocess.run(["bash", os.path.join(REPO, "examples", "slurm", "rollout_node.sh")], env=env,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == status, res.stderr
        lines = log.read_text().splitlines()
        assert len(lines) == runs and all("--listen n3:31000" in line for line in lines), lines
        assert "exited with status 137: relaunching it (1 of" in res.stderr
