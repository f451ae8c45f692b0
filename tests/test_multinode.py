"""A real two-node run on one machine: two Linux network namespaces joined by a veth pair are the "nodes".

Each namespace runs examples/slurm/node.sh (what srun starts on every node of a job) with SLURM's variables: node
rank from SLURM_NODEID, the rendezvous host from SLURM_JOB_NODELIST (host names resolve through the per-namespace
/etc/netns/<name>/hosts that `ip netns exec` mounts), one trainer rank per node, tensor parallelism 2 across the
nodes, gloo over the veth (GLOO_SOCKET_IFNAME). Nothing is routed outside the two namespaces; both are deleted
(with the veth pair and the hosts files) in a finally. Needs root and iproute2; skipped otherwise.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from distributed_harness import free_port

pytestmark = pytest.mark.slow  # two network namespaces, a training run across them

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NODE = os.path.join(REPO, "examples", "slurm", "node.sh")
SUBNET = "10.203.77"
HOSTS = ("gtponode0", "gtponode1")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    return None


def _tx_bytes(namespace: str, interface: str) -> int:
    res = subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{interface}/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True, timeout=30)
    return int(res.stdout)


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_two_namespace_nodes_rendezvous_and_train_across_a_veth_link(tmp_path):
    tag = f"{os.getpid() % 100000}"
    namespaces = [f"gtpo{tag}n0", f"gtpo{tag}n1"]
    interfaces = [f"gtpo{tag}v0", f"gtpo{tag}v1"]
    hosts_dirs = [os.path.join("/etc/netns", ns) for ns in namespaces]
    etc_netns_existed = os.path.isdir("/etc/netns")
    created = []
    try:
        for ns, hosts_dir in zip(namespaces, hosts_dirs):
            res = _ip("netns", "add", ns, check=False)
            if res.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {res.stderr.strip()}")
            created.append(ns)
            os.makedirs(hosts_dir, exist_ok=True)
            with open(os.path.join(hosts_dir, "hosts"), "w", encoding="utf-8") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} {h}\n" for i, h in enumerate(HOSTS)))
        _ip("link", "add", interfaces[0], "type", "veth", "peer", "name", interfaces[1])
        for i, (ns, interface) in enumerate(zip(namespaces, interfaces)):
            _ip("link", "set", interface, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", interface)
            _ip("-n", ns, "link", "set", interface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

        run_dir = tmp_path / "run"
        train_args = ["--config", "examples/cpu_demo.yaml", "--set", "parallel.tensor=2", "--set", "steps=2",
                      "--set", "warm_start.steps=0", "--set", "data.prompts_per_step=8",
                      # every step trains, so it has entropies and a gradient (a random model's groups are mostly
                      # all-wrong, and dynamic sampling may keep none in 2 steps)
                      "--set", "algorithm.dynamic_sampling=false", "--set",
                      "checkpoint.save_every=0", "--set", "logging.tensorboard=false", "--set",
                      "logging.progress_bar=false", "--set", f"logging.output_dir={run_dir}"]
        port = str(free_port())
        procs, logs = [], []
        for rank, (ns, interface) in enumerate(zip(namespaces, interfaces)):
            env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "PYTHON": sys.executable,
                   "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "SLURM_NNODES": "2", "SLURM_NODEID": str(rank),
                   "SLURM_JOB_NODELIST": "gtponode[0-1]", "NPROC_PER_NODE": "1", "MASTER_PORT": port,
                   "GLOO_SOCKET_IFNAME": interface}
            log = open(tmp_path / f"node{rank}.log", "w", encoding="utf-8")
            logs.append(log)
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", NODE,
                 *train_args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        try:
            codes = [p.wait(timeout=400) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        outputs = [(tmp_path / f"node{r}.log").read_text(errors="replace") for r in range(2)]
        assert codes == [0, 0], "\n".join(f"--- node {r}\n{o[-3000:]}" for r, o in enumerate(outputs))
        for rank, out in enumerate(outputs):
            assert f"node {rank}/2" in out and f"rendezvous at gtponode0:{port}, 1 ranks" in out
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        assert [r["step"] for r in rows] == [0, 1]
        assert all(r["entropy_mean"] > 0 and r["grad_norm"] >= 0 for r in rows)
        # The TP=2 all-reduces of two steps (and the rendezvous) went over the veth pair, both ways.
        assert _tx_bytes(namespaces[0], interfaces[0]) > 100_000
        assert _tx_bytes(namespaces[1], interfaces[1]) > 100_000
    finally:
        for ns in created:
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes its end of the veth, and the pair
        for hosts_dir in hosts_dirs:
            shutil.rmtree(hosts_dir, ignore_errors=True)
        if not etc_netns_existed and os.path.isdir("/etc/netns") and not os.listdir("/etc/netns"):
            os.rmdir("/etc/netns")
