"""megarl: asynchronous Pipeline RL post-training for LLMs.

Install paths:
  CPU (the embedded demo, CI):   pip install -e ".[cpu,test]"   -> pins torch==2.13.0 (CPU build)
  GPU (keep your own torch):     pip install -e ".[gpu]"         -> any torch >= 2.4 already installed
"""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Asynchronous Pipeline RL post-training of LLMs with megatron-core learners",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        # A range, not a pin: GPU users keep the torch they built for their CUDA. The `cpu` extra
        # pins the CPU build so a fresh CPU machine never pulls a multi-GB CUDA wheel.
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.17; python_version < '3.12'",
        "megatron-core>=0.16.1; python_version >= '3.12'",
        "transformers>=4.45",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "omegaconf>=2.3",
        "pyzmq>=25",
        "msgpack>=1.0",  # the wire format's metadata (megarl.distributed.wire)
        "tensorboard>=2.14",
        "matplotlib>=3.7",
        "numpy>=1.24",
    ],
    extras_require={
        # DeepSpeed (learner.backend=deepspeed) builds from source; on CPU no op is prebuilt (DS_BUILD_OPS
        # defaults to 0) and its torch requirement is unpinned, so the torch pin above holds. GPU users
        # keep the DeepSpeed they built for their CUDA (`pip install deepspeed` when they want it).
        "cpu": ["torch==2.13.0", "deepspeed==0.19.8"],
        "gpu": [],
        # peft: learner.lora on the DeepSpeed learner (its adapters are peft's; the megatron learner needs no peft).
        "lora": ["peft>=0.21"],
        # The `openai` client, for agents that train through a sampler's /v1/chat/completions (task.agent).
        "agent": ["openai>=1.40"],
        # observe.trackers=[wandb, mlflow]: the run trackers besides TensorBoard (mlflow-skinny: MLflow's client and
        # its local stores, without the server and UI).
        "trackers": ["wandb>=0.22", "mlflow-skinny>=3.0"],
        # pyarrow / datasets: the Parquet and save_to_disk dataset readers are optional for users, tested in CI;
        # openai: the agent tests drive the endpoint with the real client.
        # peft: the LoRA tests check megarl's adapters and PEFT export against peft's own LoraLayer.
        # pytest-xdist: the README's test command runs the suite on both cores (`-n 2`, one file per worker).
        # wandb, mlflow-skinny: the tracker tests log to both (wandb offline, an MLflow file store) and read back.
        "test": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "pyarrow>=14", "datasets>=2.18", "openai>=1.40",
                 "peft>=0.21", "wandb>=0.22", "mlflow-skinny>=3.0"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
