"""The run configuration: one structured dataclass tree, the single source of truth for every key.

YAML files in configs/ and `key=value` overrides are merged onto these dataclasses by
megarl.config.load, which rejects unknown keys and wrong types by name and then checks the
cross-field rules (topology, objective) in `validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.algo.config import AdvantageConfig, LossConfig


@dataclass
class RunConfig:
    dir: str = "runs/demo"  # outputs: config.yaml, metrics.jsonl, rollouts.jsonl, tensorboard/
    steps: int = 100  # learner optimizer steps
    seed: int = 0
    log_rollouts: bool = True
    tensorboard: bool = True
    progress: bool = True  # console progress line
    timeline: bool = True  # timeline/<process>.jsonl: learner spans, sampler tokens per time slice


@dataclass
class ModelConfig:
    # "embedded:<name>" builds the tiny local default once (see megarl/models/tiny.py);
    # anything else is an HF-format directory (config.json, model.safetensors, tokenizer files).
    path: str = "embedded:tiny-qwen2-arith-think"
    cache_dir: str = "~/.cache/megarl/models"


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    max_operand: int = 19
    # Mean length of the filler "thinking" run before the answer (geometric, so long-tailed);
    # 0 = answer directly. The embedded default model was warm-started with 10.
    think_mean: float = 10.0
    # A prompt whose tokens do not leave room for one completion token within the sampler's
    # context is skipped and counted; set to false to stop the run instead.
    skip_overlong_prompts: bool = True


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 48


@dataclass
class SamplerConfig:
    engine: str = "builtin"
    num_engines: int = 1  # sampler ranks; each runs one engine
    max_running: int = 32  # continuous-batching slots per engine
    max_seq_len: int = 64  # prompt + completion tokens per request (KV cache length)
    kv_on_update: str = "keep"  # "keep" the KV cache on an in-flight weight swap, or "recompute" it
    threads: int = 1  # torch intra-op threads per sampler process


@dataclass
class LearnerConfig:
    backend: str = "megatron"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 0.0
    use_distributed_optimizer: bool = False
    seed: int = 1234
    threads: int = 1


@dataclass
class AlgoConfig:
    # "pipeline": samplers never stop; one optimizer step per batch; weights applied in flight.
    # "sync": the baseline. Samplers generate exactly one batch under pi_t and wait; the learner
    # trains `sync_epochs` optimizer steps on it (pi_t's recorded log-probs stay the ratio
    # denominator), then publishes, and the next batch starts.
    mode: str = "pipeline"
    sync_epochs: int = 1
    group_size: int = 8  # samples per prompt (G)
    prompts_per_step: int = 8  # groups per learner batch
    # A sample whose oldest token is more than max_lag versions behind the learner is dropped.
    max_lag: int = 4
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)


@dataclass
class PublishConfig:
    bucket_mb: float = 16.0  # tensors are packed into flat buffers of at most this size
    timeout_s: float = 120.0  # one version's broadcast, end to end
    checksum: bool = True  # verify a CRC of every bucket on the receiving side


@dataclass
class QueueConfig:
    host: str = "127.0.0.1"  # the learner binds here; set to the node's address for multi-node
    timeout_s: float = 300.0  # the learner gives up when no sample arrives for this long


@dataclass
class DistConfig:
    backend: str = "auto"  # "gloo", "nccl" or "auto" (nccl when CUDA is available)
    timeout_s: float = 600.0  # process-group creation and learner collectives


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    dist: DistConfig = field(default_factory=DistConfig)
