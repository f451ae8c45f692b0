"""megatron_gtpo: GTPO / GRPO-S entropy-shaped RL for LLM reasoning on megatron-core."""
from setuptools import find_packages, setup

setup(
    name="megatron_gtpo",
    version="0.1.0",
    description="GTPO / GRPO-S (entropy-shaped RL) next to GRPO and DAPO, on megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_gtpo", "megatron_gtpo.*"]),
    package_data={"megatron_gtpo.data": ["eval_sets/*"]},
    install_requires=[
        # The CPU wheel of torch 2.13.0 is installed first by the Makefile on machines without CUDA.
        "torch>=2.4",
        # Tested with 0.16.1 (the newest release for Python 3.11); 0.17 may change the APIs the trainer uses.
        "megatron-core>=0.16.1,<0.17",
        "transformers>=4.45",
        "safetensors",
        "sentencepiece",
        "tokenizers",
        "pyyaml",
        "psutil",  # dist_checkpointing's async writer needs it
        "einops",
        "numpy",
        "tqdm",
        "math-verify>=0.7",
        "matplotlib",
        "tensorboard",
        # The rollout servers' channel (rollout/remote_channel.py): libzmq with CURVE (libsodium) inside the wheel.
        "pyzmq>=26",
    ],
    extras_require={
        # NVIDIA apex is optional and never a dependency: the PyPI package named "apex" is unrelated.
        # The GPU set shares one torch (constraints/gpu.txt says why these versions; `make setup-gpu` installs it).
        "gpu": ["transformer-engine[pytorch,core_cu13]==2.17.1", "vllm==0.32.0"],
        "vllm": ["vllm==0.32.0"],
        # The peer benchmark (benchmarks/peer_bench.py): TRL's GRPOTrainer beside ours; `make setup-peers` installs it
        # in a venv of its own (.venv-peers), so that neither the main install nor `make test` sees it.
        "peers": ["trl==1.16.0"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff==0.17.6"],
    },
)
