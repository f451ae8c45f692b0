"""benchmarks/peer_bench.py's matching of the two sides, without TRL: our trainer's config as the bench builds it
against the GRPOConfig arguments it gives TRL, setting by setting; TRL's "grpo" loss (written out here from TRL
1.16's GRPOTrainer._compute_loss) against our GRPO loss over the same micro-batches; the prompt token ids TRL's
tokenizer call gives against those our task trains on; the reward on both sides' decodings; the resumable records and
the results file's sections."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_gtpo.algorithms import configure_algorithm
from megatron_gtpo.algorithms.losses import token_policy_loss
from megatron_gtpo.config import load_config

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("peer_bench", REPO / "benchmarks" / "peer_bench.py")
peer_bench = sys.modules["peer_bench"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_bench)


def _ours(w, algorithm, model_dir="/models/m", prompts_path="/data/p.jsonl"):
    return load_config(None, peer_bench.ours_overrides(w, algorithm, model_dir=model_dir, prompts_path=prompts_path,
                                                       output_dir="/tmp/out", steps=4))


def test_both_sides_get_the_same_workload_and_trl_matched_our_grpo():
    w = peer_bench.Workload()
    cfg, trl = _ours(w, "grpo"), peer_bench.trl_settings(w, matched=True, output_dir="/tmp/trl", steps=4)
    r, d, o = cfg.rollout, cfg.data, cfg.optim
    assert (r.num_responses_per_prompt, d.prompts_per_step, r.max_new_tokens) == (8, 16, 64)
    # The same group size, batch, micro-batch and lengths; one optimizer step per generated batch on both sides
    assert trl["num_generations"] == r.num_responses_per_prompt
    assert trl["per_device_train_batch_size"] == d.micro_batch_size
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == d.prompts_per_step * 8
    assert d.mini_batches_per_step == d.epochs_per_step == trl["num_iterations"] == 1
    assert "steps_per_generation" not in trl and "generation_batch_size" not in trl  # TRL: = the accumulation
    assert trl["max_completion_length"] == r.max_new_tokens
    # The same sampling: temperature 1, no top-p / top-k
    assert (trl["temperature"], trl["top_p"], trl["top_k"]) == (r.temperature, r.top_p, r.top_k) == (1.0, 1.0, 0)
    # The same optimizer settings, no KL, fp32, no recomputation, the same seed and steps
    assert (trl["learning_rate"], trl["max_grad_norm"], trl["weight_decay"], trl["warmup_steps"]) == \
        (o.lr, o.grad_clip, o.weight_decay, o.warmup_steps)
    assert (trl["lr_scheduler_type"], o.lr_decay_style) == ("constant", "constant")
    assert trl["beta"] == cfg.algorithm.kl_coef == 0.0
    assert cfg.model.dtype == trl["model_init_kwargs"]["dtype"] == "float32"
    assert trl["bf16"] is False and trl["fp16"] is False
    assert trl["gradient_checkpointing"] is cfg.model.recompute_activations is False
    assert trl["seed"] == cfg.seed and trl["max_steps"] == cfg.steps == 4
    # One process, TP 1, the built-in engine, the plain prompts of the bench's file
    assert (cfg.parallel.tensor, cfg.parallel.pipeline, r.engine, d.template) == (1, 1, "builtin", "plain")
    # The same loss: our GRPO averages each sequence's token mean over the step's sequences, TRL's "grpo" too
    # (test_trl_grpo_loss_is_our_grpo_loss), with our GRPO's clip range and TRL's per-group std scaling
    algorithm = configure_algorithm(cfg.algorithm, max_new_tokens=r.max_new_tokens)
    assert algorithm.loss_agg_mode == "seq-mean-token-mean" and trl["loss_type"] == "grpo"
    clip = algorithm._policy_loss.keywords["clip"]
    assert (trl["epsilon"], trl["epsilon_high"]) == (clip.eps_low, clip.eps_high) == (0.2, 0.2)
    assert trl["scale_rewards"] == "group" and not algorithm.dynamic_sampling


def test_gtpo_row_generates_the_same_batch_and_trl_defaults_keep_only_the_workload():
    w = peer_bench.Workload(micro_batch=16)
    gtpo = _ours(w, "gtpo")
    assert configure_algorithm(gtpo.algorithm, max_new_tokens=64).dynamic_sampling is False  # no further rounds
    assert gtpo.algorithm.name == "gtpo" and gtpo.data.micro_batch_size == 16
    matched = peer_bench.trl_settings(w, matched=True, output_dir="/tmp/trl", steps=4)
    defaults = peer_bench.trl_settings(w, matched=False, output_dir="/tmp/trl", steps=4)
    assert matched["gradient_accumulation_steps"] == 8
    assert {k: matched[k] for k in defaults} == defaults  # the workload: the same in both TRL rows
    assert set(matched) - set(defaults) == {"bf16", "fp16", "gradient_checkpointing", "loss_type", "epsilon",
                                            "epsilon_high", "scale_rewards", "lr_scheduler_type"}
    with pytest.raises(SystemExit, match="must divide"):
        peer_bench.Workload(micro_batch=48).check()


def test_trl_takes_one_generation_per_optimizer_step_and_no_old_policy_pass():
    """With TRL installed (the venv of `make setup-peers`): GRPOConfig accepts the bench's arguments for both TRL rows,
    generates the step's 16 x 8 responses at once and takes one optimizer step per generation, so that
    GRPOTrainer (1.16's _generate_and_score_completions) uses the update's own log-probs as the old ones."""
    trl = pytest.importorskip("trl", reason="TRL is installed only in the peer benchmark's venv (make setup-peers)")
    w = peer_bench.Workload()
    for matched in (True, False):
        config = trl.GRPOConfig(**peer_bench.trl_settings(w, matched=matched, output_dir="/tmp/trl", steps=4))
        assert config.generation_batch_size == w.sequences and config.num_generations == w.group
        assert config.steps_per_generation == config.gradient_accumulation_steps == w.sequences // w.micro_batch
        assert config.gradient_accumulation_steps % (config.steps_per_generation * config.num_iterations) == 0
        assert (config.bf16, config.gradient_checkpointing, config.loss_type) == \
            ((False, False, "grpo") if matched else (True, True, "dapo"))


def _trl_grpo_loss(per_token_loss_BT, mask_BT, micro_batches, accumulation_steps):
    """TRL 1.16's loss_type "grpo" over an accumulated step: per micro-batch
    ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean() / accumulation steps, summed."""
    total = 0.0
    for rows in micro_batches:
        loss, mask = per_token_loss_BT[rows], mask_BT[rows].to(per_token_loss_BT.dtype)
        total = total + ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation_steps
    return total


def test_trl_grpo_loss_is_our_grpo_loss():
    """Value and gradient of our GRPO loss summed over 4 micro-batches of 3 sequences (normaliser: the 12
    sequences) equal TRL's "grpo" loss of the same step, in float64, with TRL's old log-probs the update's own
    (ratio 1)."""
    torch.manual_seed(0)
    sequences, length, micro = 12, 7, 3
    logprobs_BT = (-torch.rand(sequences, length, dtype=torch.float64)).requires_grad_()
    lengths = torch.randint(1, length + 1, (sequences,))
    mask_BT = torch.arange(length)[None, :] < lengths[:, None]
    advantages_B = torch.randn(sequences, dtype=torch.float64)
    micro_batches = [list(range(i, i + micro)) for i in range(0, sequences, micro)]
    # TRL: per-token loss -min(r A, clip(r) A) with r = exp(logp - logp.detach()) = 1
    ratio_BT = torch.exp(logprobs_BT - logprobs_BT.detach())
    per_token_BT = -torch.minimum(ratio_BT * advantages_B[:, None],
                                  ratio_BT.clamp(0.8, 1.2) * advantages_B[:, None])
    expected = _trl_grpo_loss(per_token_BT, mask_BT, micro_batches, len(micro_batches))
    (expected_grad,) = torch.autograd.grad(expected, logprobs_BT)
    cfg = _ours(peer_bench.Workload(), "grpo")
    algorithm = configure_algorithm(cfg.algorithm, max_new_tokens=64)
    ours = sum(algorithm.policy_loss(logprobs_BT[rows], logprobs_BT[rows].detach(), advantages_B[rows],
                                     mask_BT[rows], loss_normalizer=float(sequences))[0] for rows in micro_batches)
    (ours_grad,) = torch.autograd.grad(ours, logprobs_BT)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_grad, expected_grad, rtol=1e-12, atol=1e-12)
    # TRL's default, "dapo", is our token-mean: a different loss whenever lengths differ
    token_mean = sum(token_policy_loss(logprobs_BT[rows], logprobs_BT[rows].detach(), advantages_B[rows],
                                       mask_BT[rows], loss_normalizer=float(mask_BT.sum()),
                                       loss_agg_mode="token-mean")[0] for rows in micro_batches)
    assert abs(float(token_mean.detach()) - float(expected.detach())) > 1e-3


@pytest.mark.slow  # about 5 s of CPU: the tokenizer is trained on MATH-500's text
def test_trl_and_our_task_see_the_same_prompt_ids_and_eos(tmp_path):
    """The bench's assets at a small shape: the token ids TRL's GRPOTrainer gets for the prompts
    (processing_class(text=prompts)["input_ids"], TRL 1.16's _tokenize_prompts for plain prompts) equal those our
    task trains on, and the model stops at the tokenizer's EOS."""
    from transformers import AutoConfig, AutoTokenizer

    from megatron_gtpo.training.task import build_task

    w = peer_bench.Workload(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=400, prompts=4)
    assets = peer_bench.build_assets(str(tmp_path / "assets"), w)
    task = build_task(_ours(w, "grpo", assets["model_dir"], assets["prompts_path"]))
    with open(assets["prompts_path"], encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    assert len(prompts) == 4 and all(p.startswith("<|im_start|>system") for p in prompts)
    trl_ids = AutoTokenizer.from_pretrained(assets["model_dir"])(text=prompts)["input_ids"]
    assert [list(s.prompt_token_ids) for s in sorted(task.samples, key=lambda s: s.index)] == trl_ids
    assert [len(ids) for ids in trl_ids] == assets["prompt_tokens"]
    config = AutoConfig.from_pretrained(assets["model_dir"])
    assert config.eos_token_id == task.tokenizer.eos_token_id == AutoTokenizer.from_pretrained(
        assets["model_dir"]).eos_token_id
    assert config.vocab_size == task.tokenizer.vocab_size == assets["model_vocab"]
    assert peer_bench.build_assets(str(tmp_path / "assets"), w) == assets  # built once, then reused


def test_coin_reward_is_the_same_for_both_decodings_and_about_half():
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    texts = [f"response {i} with {i * 7919 % 1000} tokens" for i in range(400)]
    rewards = [peer_bench.coin_reward(t, specials) for t in texts]
    assert set(rewards) == {0.0, 1.0} and 0.4 < sum(rewards) / len(rewards) < 0.6
    # Our trainer decodes with the special tokens, TRL without them
    assert [peer_bench.coin_reward(t + "<|im_end|>", specials) for t in texts] == rewards


def test_rounds_are_complete_rounds_and_sections_are_replaced(tmp_path):
    records = tmp_path / "records.jsonl"
    lines = [{"round": 0, "row": "trl"}, {"round": 0, "row": "grpo"}, {"round": 1, "row": "trl"}]
    records.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"round": 1, "row": "gr')  # a cut line
    assert [sorted(r) for r in peer_bench.read_rounds(str(records), ["trl", "grpo"])] == [["grpo", "trl"]]
    results = tmp_path / "peers.md"
    peer_bench.write_section(str(results), "run1", "## first\n")
    peer_bench.write_section(str(results), "run2", "## second\n")
    peer_bench.write_section(str(results), "run1", "## first, more rounds\n")
    text = results.read_text()
    assert text.startswith(peer_bench.HEADER)
    assert text.count("## first") == 1 and text.index("## first, more rounds") < text.index("## second")
