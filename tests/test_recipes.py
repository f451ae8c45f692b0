"""Every recipe as documented: each example config (examples/*.yaml), and every launch that its own header, a SLURM
script's header (examples/slurm/*.sbatch, launch.sh) or examples/slurm/README.md documents, goes through the config
checks and builds the TransformerConfig a GPU run would build.

The launches are read from the files themselves, so a newly documented one is covered without touching this test:
- in a yaml's header, every `EXTRA_ARGS="..."` (its --set overrides applied together, to that yaml), and every
  `... sbatch [options] examples/slurm/SCRIPT` command (dry-run as below);
- in a script's header comments and in the README, every `... sbatch [options] examples/slurm/SCRIPT` command: the
  script runs as a dry run (DRY_RUN=1, stand-in `srun` / `scontrol`, the command's environment and a SLURM
  allocation of its --nodes / #SBATCH --nodes), and the trainer command it prints (config, every --set, nodes x ranks
  per node) is what is checked, so the script's own settings (launch.sh's variables, disaggregated.sbatch's rollout
  servers) count too.
Checked per launch: `load_config` (the config validation) accepts it; with the printed world size, the layout rules
for the model at that size (`validate_layout`); and megatron-core's TransformerConfig for that model and layout on
the machine it runs on (its own validation; a GPU with Transformer Engine, the CPU for the tiny synthetic model).
The model: the preset the yaml's header plans with (`tools/plan.py --model NAME --config THIS_FILE`), or the tiny
synthetic model. A launch a yaml's own header documents with its nodes is also planned (megatron_gtpo.planning) at
its world size and must fit an 80 GiB H100 at the training and at the generation peak.
"""
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from megatron_gtpo.config import load_config, validate_layout
from megatron_gtpo.models.accelerator import Accelerator
from megatron_gtpo.models.presets import hf_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
SLURM = os.path.join(EXAMPLES, "slurm")
YAMLS = sorted(f"examples/{name}" for name in os.listdir(EXAMPLES) if name.endswith(".yaml"))
SCRIPTS = sorted(f"examples/slurm/{name}" for name in os.listdir(SLURM) if name.endswith((".sbatch", ".sh")))
GPU = Accelerator(cuda=True, transformer_engine=True, triton=True)  # the project's GPU set (README)
CPU = Accelerator(cuda=False)

pytestmark = pytest.mark.slow  # about 15 dry runs of the SLURM scripts


@dataclass(frozen=True)
class Launch:
    where: str  # the file that documents it
    config: str
    overrides: tuple[str, ...] = ()
    world_size: int | None = None  # None: not said (config checks and the TransformerConfig only)

    def __str__(self):
        return f"{self.where}: {self.config} {' '.join(self.overrides)} ({self.world_size or '?'} ranks)"


def _header(path: str) -> list[str]:
    """The comment lines at the top of a file (before its first line of code), without their '#'."""
    lines = []
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        for line in f:
            if line.startswith("#!"):
                continue
            if not line.startswith("#") or line.startswith("#SBATCH"):
                break
            lines.append(line[1:].rstrip("\n"))
    return lines


def _sets(extra_args: str) -> tuple[str, ...]:
    """The overrides of trainer arguments `--set a=b --set c=d` (as launch.sh splits EXTRA_ARGS: on spaces)."""
    words = extra_args.split()
    assert all(w == "--set" for w in words[0::2]) and len(words) % 2 == 0, extra_args
    return tuple(words[1::2])


def _logical_lines(lines: list[str]) -> list[str]:
    """Shell lines with their backslash continuations joined."""
    out, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            out.append(current + line)
            current = ""
    return out


def _sbatch_commands(path: str) -> list[str]:
    """The documented `sbatch` commands of a script's header or of a markdown file (its indented code lines)."""
    if path.endswith(".md"):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.startswith("    ")]
    else:
        lines = _header(path)
    commands = []
    for line in _logical_lines(lines):
        line = line.split(" # ")[0]  # a trailing comment
        if re.search(r"\bsbatch\b.*examples/slurm/\S+\.(sbatch|sh)\b", line):
            commands.append(line.split("&&")[-1].strip())
    return commands


def _sbatch_default(script: str, option: str) -> int | None:
    with open(os.path.join(REPO, script), encoding="utf-8") as f:
        found = re.search(rf"^#SBATCH --{option}=(\d+)", f.read(), re.M)
    return int(found.group(1)) if found else None


_SRUN = """#!/bin/bash
nodes=1; list=""
while [[ "$1" == --* ]]; do
  case "$1" in --nodes=*) nodes=${1#--nodes=};; --nodelist=*) list=${1#--nodelist=};; esac
  shift
done
SLURMD_NODENAME=${list%%,*} SLURM_NODEID=0 SLURM_NNODES=$nodes exec "$@"
"""


def _dry_run(where: str, command: str, bin_dir) -> list[Launch]:
    """The trainer launches that a documented sbatch command's script prints in a dry run."""
    words = shlex.split(command)
    at = words.index("sbatch")
    env = dict(word.split("=", 1) for word in words[:at])
    options = [w for w in words[at + 1:] if w.startswith("--")]
    script = next(w for w in words[at + 1:] if not w.startswith("--"))
    option = {o.split("=")[0][2:]: o.split("=", 1)[1] for o in options if "=" in o}
    nodes = int(option.get("nodes", _sbatch_default(script, "nodes") or 1))
    gpus = int(option.get("gpus-per-node", _sbatch_default(script, "gpus-per-node") or 8))
    env.pop("PYTHON", None)  # this test's interpreter, not the documented one
    names = ",".join(f"n{i}" for i in range(1, nodes + 1))
    run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable, "PYTHONPATH": REPO,
               "DRY_RUN": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "recipe", "SLURM_JOB_NODELIST": names,
               "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_GPUS_ON_NODE": str(gpus),
               "SLURM_SUBMIT_DIR": REPO, "TORCHRUN_LOG_DIR": "", "HOME": os.environ.get("HOME", "/tmp"),
               "MASTER_ADDR": "n1", **env}  # node.sh would ask python for the node list's first host
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "%s\\n" '
                                      f'{names.replace(",", " ")}\nexit 0\n')
    res = subprocess.run(["bash", os.path.join(REPO, script)], env=run_env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 0, (where, command, res.stdout + res.stderr)
    launches = []
    for line in res.stdout.splitlines():
        if "megatron_gtpo.train" not in line:
            continue
        args = shlex.split(line)
        flag = {a.split("=")[0]: a.split("=", 1)[1] for a in args if a.startswith("--n") and "=" in a}
        config = args[args.index("--config") + 1]
        overrides = tuple(args[i + 1] for i, a in enumerate(args) if a == "--set")
        launches.append(Launch(f"{where}: {command}", config, overrides,
                               int(flag["--nnodes"]) * int(flag["--nproc_per_node"])))
    assert launches, (where, command, res.stdout)
    return launches


def documented_launches(bin_dir) -> list[Launch]:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\nexit 0\n")
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    launches = []
    for path in YAMLS:
        launches.append(Launch(path, path))
        header = " ".join(_header(path))
        launches += [Launch(path, path, _sets(extra)) for extra in re.findall(r'EXTRA_ARGS="([^"]*)"', header)]
        for command in _sbatch_commands(path):
            launches += _dry_run(path, command, bin_dir)
    for path in SCRIPTS + ["examples/slurm/README.md"]:
        for command in _sbatch_commands(path):
            launches += _dry_run(path, command, bin_dir)
    return launches


def model_of(config_path: str, cfg) -> tuple[dict, Accelerator]:
    """The HF config a recipe trains (the preset its header plans with, the tiny synthetic model, or the model
    shipped in the repository that its model.hf_dir names) and the machine it runs on."""
    if cfg.model.tiny_synthetic:
        from megatron_gtpo.data.synthetic import tiny_model_hf_config

        return tiny_model_hf_config(), CPU
    if cfg.model.hf_dir and os.path.isdir(os.path.join(REPO, cfg.model.hf_dir)):
        from megatron_gtpo.models.qwen import load_hf_config

        return load_hf_config(os.path.join(REPO, cfg.model.hf_dir)), CPU
    planned = re.search(rf"tools/plan\.py --model (\S+) --config {re.escape(config_path)}\b",
                        " ".join(_header(config_path)))
    assert planned, f"{config_path}: its header names no model (`tools/plan.py --model NAME --config {config_path}`)"
    return hf_config(planned.group(1)), GPU


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return documented_launches(tmp_path_factory.mktemp("recipes") / "bin")


def test_the_documented_launches_are_found(launches):
    configs = {launch.config for launch in launches}
    assert set(YAMLS) <= configs and configs <= set(YAMLS), configs - set(YAMLS)
    extra = [launch for launch in launches if launch.overrides]
    # What the files document today (more may come): the 1-node Qwen3-30B-A3B layout in the yaml, its sbatch and the
    # README; the disaggregated job's rollout settings; the CPU config through launch.sh.
    assert any("model.recompute_activations=true" in launch.overrides and launch.world_size == 8
               and launch.where.startswith("examples/slurm/qwen3-30b-a3b.sbatch") for launch in extra)
    assert any("rollout.schedule.max_staleness=1" in launch.overrides for launch in extra)
    assert any(launch.config == "examples/cpu_demo.yaml" and launch.world_size == 2 for launch in extra)
    # The paper-length recipes' own headers: context parallelism on 4 and 8 nodes (32B), 2 nodes (30B-A3B).
    assert {(launch.config, launch.world_size) for launch in launches if launch.where.startswith(launch.config)
            and launch.world_size} >= {("examples/qwen2.5-32b-dapo-20k.yaml", 32),
                                       ("examples/qwen2.5-32b-dapo-20k.yaml", 64),
                                       ("examples/qwen3-30b-a3b-dapo-20k.yaml", 16)}


def test_every_documented_launch_passes_the_config_checks_and_builds_its_gpu_configuration(launches):
    from megatron_gtpo.config import ConfigError
    from megatron_gtpo.models.moe import RouterLosses
    from megatron_gtpo.models.qwen import ModelShape, transformer_config_from_hf

    failures = []
    for launch in launches:
        try:
            cfg = load_config(os.path.join(REPO, launch.config), list(launch.overrides))
            hf, machine = model_of(launch.config, cfg)
            if launch.world_size is not None:
                validate_layout(cfg, world_size=launch.world_size, shape=ModelShape.from_hf(hf))
            p, m = cfg.parallel, cfg.model
            transformer_config_from_hf(
                hf, tensor_parallel=p.tensor, pipeline_parallel=p.pipeline,
                virtual_pipeline_parallel=p.virtual_pipeline, sequence_parallel=p.sequence_parallel,
                expert_parallel=p.expert, expert_tensor_parallel=p.expert_tensor, context_parallel=p.context,
                context_comm=p.context_comm, params_dtype=getattr(torch, m.dtype),
                recompute_activations=m.recompute_activations,
                accelerator=machine, transformer_engine=machine.transformer_engine,
                packed_sequences=cfg.data.pack_sequences,
                router_losses=RouterLosses(m.moe.aux_loss_coef, m.moe.z_loss_coef))
        except (ConfigError, ValueError, AssertionError) as e:
            failures.append(f"{launch}\n    {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def test_the_launches_a_recipe_documents_fit_an_80gib_gpu(launches):
    from megatron_gtpo.layout import ParallelLayout
    from megatron_gtpo.models.qwen import ModelShape
    from megatron_gtpo.planning import plan, settings_from_config, workload_from_config

    planned = []
    for launch in launches:
        if not (launch.where.startswith(launch.config + ":") and launch.world_size):
            continue
        cfg = load_config(os.path.join(REPO, launch.config), list(launch.overrides))
        p = cfg.parallel
        layout = ParallelLayout.from_world_size(launch.world_size, tensor=p.tensor, pipeline=p.pipeline,
                                                context=p.context, virtual_pipeline=p.virtual_pipeline,
                                                sequence_parallel=p.sequence_parallel, expert=p.expert,
                                                expert_tensor=p.expert_tensor)
        result = plan(ModelShape.from_hf(model_of(launch.config, cfg)[0]), layout, workload_from_config(cfg),
                      settings_from_config(cfg, gpu_memory_gib=80.0))
        assert result.fits, (str(launch), result.reasons)
        assert max(result.memory_gib["training_peak"], result.memory_gib["generation_peak"]) <= 80, str(launch)
        planned.append((launch.config, layout.context))
    assert {("examples/qwen2.5-32b-dapo-20k.yaml", 2), ("examples/qwen3-30b-a3b-dapo-20k.yaml", 2)} <= set(planned)
