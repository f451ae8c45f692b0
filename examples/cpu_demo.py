"""The tiny CPU demo (placeholder until the trainer lands): builds a tiny random Qwen2 model and scores token
sequences with `megatron_gtpo.score` at TP=2 on two gloo processes."""
import json
import os
import subprocess
import sys
import tempfile

import torch


def main():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = os.path.abspath(os.environ.get("DEMO_OUT", "outputs/cpu_demo"))
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    model_dir = os.path.join(out_dir, "tiny_qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for _ in range(4):
            f.write(json.dumps({"token_ids": torch.randint(0, 1000, (12,)).tolist()}) + "\n")
    out = os.path.join(out_dir, "scores.jsonl")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "megatron_gtpo.score",
                    "--hf", model_dir, "--input", f.name, "--output", out, "--tp", "2"], check=True)
    first = json.loads(open(out).readline())
    print(f"scored 4 sequences at TP=2; first entropies {[round(x, 3) for x in first['entropy'][:4]]}; "
          f"written to {out}")


if __name__ == "__main__":
    main()
