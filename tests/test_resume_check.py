"""A relaunch continues the run in its output directory only with the settings that run trained with: one that
changes the algorithm, its reward shaping or the data is refused naming each changed key; one with nothing left to
do says so and builds nothing (training/resume_check.py, checkpointing.relaunch_check; in process, no torchrun)."""
from __future__ import annotations

import functools
import json
import os

import pytest

from megatron_gtpo.config import load_config, parse_config, to_dict
from megatron_gtpo.training.resume_check import check_resume, check_rollout_schedule

DEMO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "examples", "cpu_demo.yaml")


def _saved(**changes) -> dict:
    """The demo's config as a checkpoint saves it (JSON), with `changes` ({"algorithm.name": "grpo"})."""
    saved = json.loads(json.dumps(to_dict(load_config(DEMO_CONFIG))))
    for key, value in changes.items():
        *path, name = key.split(".")
        functools.reduce(dict.__getitem__, path, saved)[name] = value
    return saved


@pytest.mark.parametrize("sets,message", [
    (["algorithm.name=grpo_s"], "(algorithm.name 'gtpo' -> 'grpo_s')"),
    (["algorithm.gtpo.alpha2=0.3", "data.seed=5"], "(algorithm.gtpo.alpha2 0.1 -> 0.3, data.seed 1234 -> 5)"),
    (["algorithm.gtpo.entropy_clip=[0.1, 2.0]"], "(algorithm.gtpo.entropy_clip None -> [0.1, 2.0])"),
    (["model.moe.routing_replay=rollout"], "(model.moe.routing_replay 'none' -> 'rollout')"),
    (["rollout.num_responses_per_prompt=4"], "(rollout.num_responses_per_prompt 8 -> 4)"),
    (["data.source=jsonl", "data.path=x.jsonl"],
     "(data.source 'synthetic' -> 'jsonl', data.path None -> 'x.jsonl')"),
])
def test_a_resume_that_changes_what_the_run_trains_is_refused_naming_each_key(sets, message):
    cfg = parse_config(DEMO_CONFIG, sets)
    with pytest.raises(ValueError) as error:
        check_resume(_saved(), cfg, "out/checkpoints/step_00000050")
    assert str(error.value) == (
        f"out/checkpoints/step_00000050 was trained with other settings than this run's {message}, which a resumed "
        "run may not change: to start a new run, give it another logging.output_dir (with "
        "model.load=out/checkpoints/step_00000050 to start from these weights)")


def test_steps_the_schedule_the_layout_and_the_engine_may_change_on_resume():
    cfg = load_config(DEMO_CONFIG, ["steps=400", "optim.lr=3e-4", "optim.lr_decay_style=linear",
                                    "parallel.tensor=1", "parallel.pipeline=2", "data.micro_batch_size=4",
                                    "rollout.max_new_tokens=6", "rollout.temperature=0.7", "checkpoint.keep_last=5",
                                    "logging.tensorboard=false", "seed=3"])
    check_resume(_saved(), cfg, "ckpt")


def test_a_key_the_checkpoint_lacks_counts_as_its_default():
    saved = _saved()
    del saved["algorithm"]["dual_clip"], saved["algorithm"]["rollout_correction"]  # written before these keys existed
    check_resume(saved, load_config(DEMO_CONFIG), "ckpt")
    with pytest.raises(ValueError, match=r"\(algorithm.dual_clip None -> 3.0\)"):
        check_resume(saved, load_config(DEMO_CONFIG, ["algorithm.dual_clip=3.0"]), "ckpt")


def test_a_checkpoint_saved_before_the_engine_and_schedule_sections_resumes():
    """A checkpoint's config written with the flat engine keys (before rollout.builtin / vllm / remote) and the flat
    rollout schedule (before rollout.schedule) is read in today's keys: its engine options are not fixed on resume,
    and its schedule, with rollouts in flight, is the section's."""
    saved = _saved(**{"rollout.engine": "builtin_remote", "algorithm.rollout_correction.rollout_is": "token"})
    for section in ("builtin", "vllm", "remote", "schedule"):
        del saved["rollout"][section]
    saved["rollout"].update(builtin_max_batch_tokens=None, vllm_gpu_memory_utilization=0.5,
                            vllm_kv_cache_memory_bytes=None, vllm_hf_dir=None, vllm_tensor_parallel=1,
                            remote_addresses=["h:1"], remote_connect_timeout_s=600.0, remote_request_timeout_s=1800.0,
                            remote_reconnect_timeout_s=0.0, max_staleness=1, partial_rollouts=False,
                            partial_segment_tokens=None, rounds_ahead=0)  # a schedule older than oversample_batches
    cfg = load_config(DEMO_CONFIG, ["rollout.engine=builtin_remote", "rollout.remote.addresses=[h:2]",
                                    "rollout.schedule.max_staleness=1",
                                    "algorithm.rollout_correction.rollout_is=token"])
    check_resume(saved, cfg, "ckpt")
    check_rollout_schedule(saved, cfg, "ckpt")
    cfg.rollout.schedule.max_staleness = 2
    with pytest.raises(ValueError, match=r"\(rollout.schedule.max_staleness 1 -> 2\)"):
        check_rollout_schedule(saved, cfg, "ckpt")


@pytest.mark.parametrize("key, value", [("oversample_batches", 1), ("update_during_generation", True),
                                        ("rounds_ahead", 1), ("ahead_schedule", "when_idle")])
def test_with_rollouts_in_flight_the_whole_schedule_section_is_fixed(key, value):
    """The resume check compares the rollout.schedule section, not a list of its keys: every key of it, set other
    than the checkpoint's, is refused naming it (and nothing is checked where no rollout is in flight)."""
    stale = ["rollout.engine=builtin_remote", "rollout.remote.addresses=[h:1]", "rollout.schedule.max_staleness=1",
             "algorithm.rollout_correction.rollout_is=token", "rollout.schedule.rounds_ahead=1"]
    saved = json.loads(json.dumps(to_dict(load_config(DEMO_CONFIG, stale))))
    cfg = parse_config(DEMO_CONFIG, stale)
    saved["rollout"]["schedule"][key] = {"rounds_ahead": 2}.get(key, value)
    with pytest.raises(ValueError, match=f"under another rollout schedule than this run's \\(rollout.schedule.{key} "):
        check_rollout_schedule(saved, cfg, "ckpt")
    saved = json.loads(json.dumps(to_dict(load_config(DEMO_CONFIG))))  # on-policy: nothing in flight
    saved["rollout"]["schedule"][key] = value
    check_rollout_schedule(saved, parse_config(DEMO_CONFIG), "ckpt")


# The algorithm section as a checkpoint saved it before each algorithm had its own section: every option flat, those
# of the algorithms not chosen included (and not read).
OLD_ALGORITHM = {"name": "gtpo", "alpha1": 1.0, "alpha2": 0.1, "beta1": 1.0, "beta2": 0.1, "norm_scope": "batch",
                 "entropy_clip": None, "eps_low": None, "eps_high": None, "dual_clip": None,
                 "sequence_ratio": "arithmetic", "kl_coef": 0.0, "entropy_coef": 0.0, "clip_cov_ratio": 0.0002,
                 "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.002, "kl_cov_coef": 1.0,
                 "entropy_token_fraction": None, "dynamic_sampling": None, "max_resample_rounds": 3,
                 "length_penalty": None, "overlong_max_len": None, "overlong_cache_len": None,
                 "group_relative_gamma": 0.75, "rollout_is": "none", "rollout_is_cap": 2.0, "rollout_rs": "none",
                 "rollout_rs_bounds": [0.5, 2.0], "routing_replay": "none"}


def _saved_flat(**algorithm) -> dict:
    saved = _saved()
    saved["algorithm"] = {**OLD_ALGORITHM, **algorithm}
    moe = saved["model"].pop("moe")
    saved["model"].update(moe_aux_loss_coef=moe["aux_loss_coef"], moe_z_loss_coef=moe["z_loss_coef"])
    return saved


@pytest.mark.parametrize("saved,same,changed", [
    # the options of the algorithm chosen are read in their new places
    (dict(alpha2=0.3, entropy_clip=[0.1, 2.0], rollout_is="token"),
     ["algorithm.gtpo.alpha2=0.3", "algorithm.gtpo.entropy_clip=[0.1, 2.0]",
      "algorithm.rollout_correction.rollout_is=token"],
     "(algorithm.gtpo.alpha2 0.3 -> 0.1, algorithm.gtpo.entropy_clip [0.1, 2.0] -> None, "
     "algorithm.rollout_correction.rollout_is 'token' -> 'none')"),
    (dict(name="grpo_s", entropy_clip=[0.1, 2.0], beta2=0.2, alpha2=0.5),
     ["algorithm.name=grpo_s", "algorithm.grpo_s.entropy_clip=[0.1, 2.0]", "algorithm.grpo_s.beta2=0.2"],
     "(algorithm.name 'grpo_s' -> 'gtpo', algorithm.grpo_s.beta2 0.2 -> 0.1, algorithm.grpo_s.entropy_clip "
     "[0.1, 2.0] -> None)"),
    (dict(name="dapo", overlong_max_len=100), ["algorithm.name=dapo", "algorithm.overlong.max_len=100"],
     "(algorithm.name 'dapo' -> 'gtpo', algorithm.overlong.max_len 100 -> None)"),
    # those of the algorithms not chosen were never read: a run without them resumes
    (dict(name="dapo", alpha1=7.0, kl_cov_coef=3.0, entropy_clip=[0.1, 2.0], group_relative_gamma=0.1,
          rollout_is_cap=5.0), ["algorithm.name=dapo"], "(algorithm.name 'dapo' -> 'gtpo')"),
    (dict(routing_replay="rollout"), ["model.moe.routing_replay=rollout"],
     "(model.moe.routing_replay 'rollout' -> 'none')"),
])
def test_a_checkpoint_saved_with_the_flat_algorithm_options_resumes_in_their_new_places(saved, same, changed):
    """An older checkpoint's config holds every algorithm's options flat in `algorithm` (and routing replay there):
    a run with the same settings in their new places resumes from it; one without them is refused naming the new
    keys."""
    saved = _saved_flat(**saved)
    check_resume(saved, parse_config(DEMO_CONFIG, same), "ckpt")
    with pytest.raises(ValueError) as error:
        check_resume(saved, parse_config(DEMO_CONFIG), "ckpt")
    assert f"ckpt was trained with other settings than this run's {changed}, which" in str(error.value)


def _finished_run(output_dir, step: int) -> str:
    """A checkpoint directory as a finished demo run leaves it (only what a relaunch reads before building)."""
    checkpoint = output_dir / "checkpoints" / f"step_{step:08d}"
    checkpoint.mkdir(parents=True)
    config = _saved(**{"logging.output_dir": str(output_dir)})
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": step, "config": config}))
    (output_dir / "checkpoints" / "latest").write_text(checkpoint.name + "\n")
    return str(checkpoint)


@pytest.fixture
def built(monkeypatch):
    """The Trainers train.main builds (none, if it stops before), in a process that sees itself as rank 0 of the
    demo's 2 under torchrun."""
    import uuid

    import megatron_gtpo.training.trainer as trainer

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)):
        monkeypatch.setenv(name, value)
    built = []
    monkeypatch.setattr(trainer, "Trainer", lambda cfg: built.append(cfg) or pytest.fail("a Trainer was built"))
    return built


def test_the_readme_command_after_the_demo_is_refused_before_anything_is_built(tmp_path, built):
    """The README's first training command once read --set algorithm.name=grpo_s in the demo's output directory,
    resumed the finished GTPO run and exited 0 having trained nothing."""
    from megatron_gtpo.train import main

    checkpoint = _finished_run(tmp_path, 250)
    with pytest.raises(ValueError, match=f"^{checkpoint} was trained with other settings than this run's "
                                         r"\(algorithm.name 'gtpo' -> 'grpo_s'\)"):
        main(["--config", DEMO_CONFIG, "--set", f"logging.output_dir={tmp_path}", "--set", "algorithm.name=grpo_s"])
    assert built == []


def test_a_resume_with_nothing_left_to_do_says_so_and_builds_nothing(tmp_path, built, capsys):
    from megatron_gtpo.train import main

    checkpoint = _finished_run(tmp_path, 250)
    assert main(["--config", DEMO_CONFIG, "--set", f"logging.output_dir={tmp_path}"]) == 0
    assert built == []
    assert capsys.readouterr().err.strip() == (
        f"nothing left to do: {checkpoint} is at step 250 of this run's steps = 250. To train on, raise steps "
        "(--set steps=N); to start a new run, give it another logging.output_dir")
