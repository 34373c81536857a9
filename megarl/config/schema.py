"""The run configuration: one structured dataclass tree, the single source of truth for every key.

YAML files in configs/ and `key=value` overrides are merged onto these dataclasses by
megarl.config.load, which rejects unknown keys and wrong types by name and then checks the
cross-field rules (topology, objective) in `validate`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from megarl.algo.config import AdvantageConfig, CriticConfig, DistillConfig, LossConfig


@dataclass
class RunConfig:
    dir: str = "runs/demo"  # outputs: config.yaml, metrics.jsonl, rollouts.jsonl, timeline/, the trackers' files
    steps: int = 100  # learner optimizer steps
    seed: int = 0  # seeds the prompt stream and sampling (each sampler: run.seed with its rank)
    log_rollouts: bool = True  # rollouts.jsonl: every trained sample (prompt, completion, reward, versions)
    progress: bool = True  # console progress line
    timeline: bool = True  # timeline/<process>.jsonl: learner spans, sampler tokens per time slice
    # Continue from the latest checkpoint in checkpoint.dir: "true" (it must exist), "auto" (if one
    # exists, else start fresh) or "false" (start fresh; refused if checkpoints would be overwritten).
    # docs/checkpoint.md says exactly what a resumed run continues.
    resume: str = "false"
    # A fresh run (resume false) refuses a run.dir holding another run's metrics.jsonl, rollouts.jsonl or
    # timeline/; true deletes those outputs (and tensorboard/) first. Checkpoints are never deleted.
    overwrite: bool = False


# sampler.engine=vllm swaps an embedded model for its variant with head_dim >= 32 (vLLM's CPU attention needs it;
# megarl.config.load picks it, megarl/embedded/registry.py builds it).
VLLM_VARIANTS = {"tiny-qwen2-count": "tiny-qwen2-count-hd32", "tiny-qwen2-tool": "tiny-qwen2-tool-hd32"}


@dataclass
class ModelConfig:
    # "embedded:<name>" builds the tiny local default once (see megarl/embedded/tiny.py);
    # anything else is an HF-format directory (config.json, model.safetensors, tokenizer files).
    path: str = "embedded:tiny-qwen2-arith-think"
    cache_dir: str = "~/.cache/megarl/models"  # embedded models (built once per name) and passed model checks (check_memo.py)


# the built-in tasks whose samples are episodes (megarl/rollout/episode.py)
MULTI_TURN_TASKS = ("tool_arith",)


@dataclass
class SandboxConfig:
    """Limits of sandboxed code (megarl/rollout/sandbox.py; docs/security.md)."""

    cpu_s: float = 5.0  # CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    disk_mb: int = 16  # largest file (RLIMIT_FSIZE); with namespaces also the working directory's size
    max_processes: int = 1  # 1 = the program alone (no fork, no thread); > 1 needs a non-root uid (RLIMIT_NPROC)
    max_output_kb: int = 256  # stdout and stderr kept, per stream; more kills the program
    network: bool = False  # False: no sockets (seccomp) and no interfaces (net namespace)
    # Without user namespaces the filesystem is not read-only for the code (docs/security.md, "Sandbox
    # modes"): true refuses to run then, false runs with the process, rlimit and seccomp layers only
    # (as a non-root user; as root the fallback is refused).
    require_namespaces: bool = True

    def check(self) -> None:
        """ValueError naming the field of a limit that is out of range or cannot be enforced here."""
        for name in ("cpu_s", "memory_mb", "disk_mb", "max_processes", "max_output_kb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name}: must be > 0, got {getattr(self, name)}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox.memory_mb: must be >= 64 (the Python interpreter itself needs it), "
                             f"got {self.memory_mb}")
        if self.max_processes > 1 and os.geteuid() == 0:
            raise ValueError("sandbox.max_processes: more than 1 cannot be enforced for uid 0 (the kernel exempts "
                             "root from RLIMIT_NPROC); keep it at 1 or run megarl as a non-root user")


@dataclass
class TaskConfig:
    # arithmetic | count | lap_count | python_output (code execution) | jsonl (a prompt dataset) | tool_arith (multi-turn, a tool)
    name: str = "arithmetic"
    max_operand: int = 19  # name=arithmetic: operands drawn uniformly from 0..max_operand
    # name=count ("d-k=" -> "defghijk"): mean and cap of the run length, drawn long-tailed (geometric).
    length_mean: float = 8.0
    max_length: int = 48  # name=count: the longest run (see length_mean)
    # name=lap_count ("3k=" -> "3a..Z2a..Z1a..Z0a..k", megarl/rollout/lap_count.py): mean and cap of the number of
    # full alphabet laps, drawn long-tailed (geometric); a completion is 53 tokens a lap plus lap 0.
    lap_mean: float = 1.5
    max_laps: int = 9  # name=lap_count: the most full laps (<= 9: the lap count is one digit; see lap_mean)
    # Mean length of the filler "thinking" run before the answer (geometric, so long-tailed);
    # 0 = answer directly. The embedded default model was warm-started with 10.
    think_mean: float = 10.0
    # A prompt whose tokens do not leave room for one completion token within the sampler's
    # context is skipped and counted; set to false to stop the run instead.
    skip_overlong_prompts: bool = True
    # name=jsonl: a .jsonl or .parquet file, or a directory written by `datasets`' save_to_disk
    # (megarl/rollout/datasets.py); each row gives a prompt and its answer, other fields go to meta.
    path: str = ""
    prompt_field: str = "prompt"  # the row field holding the prompt text
    answer_field: str = "answer"  # the row field holding the answer the reward compares with
    # A dataset row's source (verl's convention: "data_source"): samples carry it, and the learner reports each
    # source's reward (reward/source/<name>) and rollouts.jsonl records it; a row without the field has none.
    source_field: str = "data_source"
    on_bad_row: str = "error"  # a malformed row or one missing a field: "error" (names file:line) or "skip" (counted)
    # The reward: "" = the task's own; "python_output" = run the completion as a Python program in the
    # sandbox and compare its stdout with the answer; "package.module:function" = a user function
    # called as fn(prompt, completion, answer, meta) -> float (the contract: docs/rewards.md).
    reward_fn: str = ""
    reward_sandbox: bool = False  # run reward_fn in the sandbox, a fresh limited process per call
    reward_timeout_s: float = 2.0  # a reward call (or sandboxed program) running longer is killed: failed reward
    # All reward calls of one group (algo.group_size samples) together; once spent, the group's remaining
    # samples fail without a call and the sampler says so, so a hanging reward cannot stall generation.
    reward_group_budget_s: float = 4.0
    # The run stops, showing the first failure, once more than this share of a batch's worth of the
    # samples the learner received last had a failed reward (raised, timed out, not a number); 1 = never.
    max_reward_error_frac: float = 0.1
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # limits of sandboxed code
    # Multi-turn tasks (name=tool_arith; megarl/rollout/episode.py): an episode ends, truncated with reward 0,
    # after max_turns model turns or max_episode_tokens tokens after the prompt (model and environment
    # together; 0 = only sampler.max_seq_len bounds it). Environment steps run on env_workers threads; a
    # step that raises, returns a malformed observation or runs past env_timeout_s fails its episode (counted).
    max_turns: int = 4
    max_episode_tokens: int = 0
    env_timeout_s: float = 10.0
    env_workers: int = 4
    # name=tool_arith: operands of `digits` digits; a tool call (model-written Python, sandboxed) is killed
    # after tool_timeout_s and answered with the limit it broke.
    digits: int = 2
    tool_timeout_s: float = 5.0
    # "package.module:function": every episode is fn(base_url, prompt, answer, meta) -> reward, an agent
    # talking to this sampler's OpenAI-compatible /v1/chat/completions at base_url (megarl/rollout/agent.py),
    # on one of env_workers threads; prompts from task.name. An agent call running past agent_timeout_s fails.
    agent: str = ""
    agent_timeout_s: float = 300.0
    # "verifiers:<id>": a verifiers environment (an installed package or a module on PYTHONPATH) supplies the prompts
    # (its dataset), runs each episode through the agent endpoint and scores it (megarl/rollout/verifiers_adapter.py).
    # "openenv:<module>:<attr>": an OpenEnv environment's server app (what `uvicorn <module>:<attr>` serves), started
    # locally; its episodes, reset with seeds 0..env_tasks-1, are the prompts (megarl/rollout/openenv_adapter.py).
    env: str = ""
    env_tasks: int = 64  # openenv: how many reset seeds (0..env_tasks-1) are the prompts
    # The largest request body the agent endpoint reads (bytes; larger: 413, nothing of it parsed).
    # 0 = max(1 MiB, 32 bytes x sampler.max_seq_len): a request resends the whole history as JSON.
    agent_max_request_bytes: int = 0
    # How the endpoint reads tool calls from replies to requests with `tools` (megarl/rollout/tool_calls.py):
    # auto (by the chat template: <tool_call> -> hermes, <|channel|> -> harmony, <|python_tag|> -> llama3),
    # hermes, llama3, harmony, or none (tools refused).
    tool_parser: str = "auto"


@dataclass
class SamplingConfig:
    """How the samplers draw training completions."""

    temperature: float = 1.0  # softmax temperature of the sampled tokens
    top_p: float = 1.0  # nucleus sampling: the smallest token set of this much probability (1 = off)
    top_k: int = 0  # only the k most likely tokens (0 = off)
    max_new_tokens: int = 48  # completion tokens per request (a multi-turn episode: per model turn)


@dataclass
class SGLangConfig:
    """sampler.engine=sglang: each sampler rank starts one server and drives it over HTTP (docs/sglang.md)."""

    # "sglang": `python -m sglang.launch_server` (GPU); "builtin": megarl's SGLang-compatible server around
    # the built-in engine (`python -m megarl.sampler.sglang_server`, CPU, one process: tp must be 1).
    server: str = "builtin"
    server_args: list[str] = field(default_factory=list)  # extra launch flags, e.g. ["--mem-fraction-static", "0.8"]
    tp: int = 1  # GPUs per server (SGLang --tp-size); the server's TP workers all join the weight-update group
    gpus_per_node: int = 8  # where sampler servers may go: the GPUs of a node after its learner ranks
    port: int = 0  # HTTP port of sampler 0's server (sampler i uses port + i); 0 = a free port each
    startup_timeout_s: float = 900.0  # server start until /health answers
    request_timeout_s: float = 600.0  # every HTTP call; a /generate stream fails after this long without data
    # After an update: "keep" SGLang's prefix cache, or "flush" it (POST /flush_cache; SGLang flushes only
    # when no request is running or waiting, so in pipeline mode most flushes are skipped and counted).
    cache_on_update: str = "keep"
    # /update_weights_from_distributed wire format: one broadcast per publish bucket ("flattened_bucket",
    # SGLang's load_format) or one broadcast per tensor ("per_tensor", every SGLang 0.5.x).
    weight_format: str = "flattened_bucket"
    # The learner address the servers rendezvous at for the weight-update group; "" = queue.host (the learner
    # node's address, which launch/torchrun_multi_node.sh sets).
    update_group_host: str = ""
    update_group_port: int = 0  # 0 = a free port on the learner
    # A prompt that leaves fewer than this many new tokens within sampler.max_seq_len (the server's
    # --context-length) is skipped and counted (sampler skipped_overlong_prompts); every other request
    # asks for min(sampling.max_new_tokens, max_seq_len - prompt) tokens (SGLang refuses more).
    min_new_tokens: int = 1


@dataclass
class VLLMConfig:
    """sampler.engine=vllm: each sampler rank starts one vLLM server (its own environment) and drives it over HTTP
    (docs/vllm.md). Weights reach the sampler rank over megarl's publish groups, then the server over a local gloo
    group, applied in flight (pause keep -> load -> resume)."""

    server_args: list[str] = field(default_factory=list)  # extra vLLM launch flags, passed through
    startup_timeout_s: float = 600.0  # server start (vLLM imports, model load, warm-up) until /health answers
    request_timeout_s: float = 300.0  # every HTTP call; a stream fails after this long without data
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the server's KV cache on CPU
    # True: no torch.compile (start-up ~40 s faster on the CPU machines; slower decode for big models).
    enforce_eager: bool = True
    # vLLM's prefix cache: off by default, so no request reuses KV an older version computed; true needs
    # sampler.kv_on_update=recompute (whose pause resets the prefix cache).
    prefix_caching: bool = False


@dataclass
class SamplerConfig:
    # "builtin" (torch engine in the sampler process), "sglang" or "vllm" (a server per sampler)
    engine: str = "builtin"
    num_engines: int = 1  # sampler engines; each runs on `tp` sampler ranks
    # Built-in engine tensor parallelism: ranks per engine. 1, or learner.tp: then learner TP rank r sends
    # only its shard to TP rank r of every engine (docs/sampler.md#tensor-parallelism).
    tp: int = 1
    max_running: int = 32  # continuous-batching slots per engine (sglang: requests in flight per server)
    max_seq_len: int = 64  # prompt + completion tokens per request (KV cache length)
    # "keep" the KV cache on an in-flight weight swap, or "recompute" it (sglang: pause mode in_place / retract;
    # vllm: /pause clear_cache=false / true)
    kv_on_update: str = "keep"
    # Built-in engine: prompt tokens per row in one prefill forward; a longer prompt (or a kv_on_update=recompute
    # re-prefill) runs in chunks of this many, so its attention is [chunk, length], not [length, length]
    # (docs/sampler.md#long-contexts).
    prefill_chunk: int = 2048
    # Built-in engine's KV cache: "contiguous" (max_seq_len positions preallocated per slot; the faster decode at
    # short contexts) or "paged" (a pool of kv_blocks blocks of kv_block_size positions shared by the slots, each
    # request holding only the blocks it reaches; a request waits in the queue until the pool can reserve its
    # prompt + max_new_tokens) (docs/sampler.md#long-contexts).
    kv_layout: str = "contiguous"
    kv_block_size: int = 32  # paged: positions per block
    kv_blocks: int = 0  # paged: blocks in the pool; 0 = max_running x max_seq_len positions' worth
    # Built-in engine's model: "auto" (the native forward of a family of docs/models.md, transformers' own
    # modules for any other causal LM), "native" or "hf" (the generic one: docs/models.md#the-generic-path)
    model_impl: str = "auto"
    threads: int = 1  # torch intra-op threads per sampler process
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class DeepSpeedConfig:
    """learner.backend=deepspeed (megarl/learner/deepspeed.py; docs/learner.md#deepspeed)."""

    zero_stage: int = 3  # 1: optimizer state, 2: + gradients, 3: + parameters partitioned over the DP ranks
    offload_optimizer: bool = False  # Adam state (and its step) on the CPU
    offload_params: bool = False  # stage 3 only: parameters on the CPU between uses


# learner.lora.target_modules: a decoder layer's adaptable HF projections, and those that one megatron linear
# computes together (megarl/learner/lora.py adapts the linear, so they are adapted together or not at all).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_FUSED_GROUPS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


@dataclass
class LoraConfig:
    """learner.lora: train a low-rank adapter on the frozen base model instead of every weight (docs/lora.md).
    Only the adapter gets gradients and optimizer state; each version publishes only the adapter, and the
    built-in engine applies it (W = W_base + alpha / rank * B @ A) at a step boundary like full weights.
    Megatron learner: megarl's own adapter on its linears; DeepSpeed learner: peft's (pip install ".[lora]")."""

    rank: int = 0  # r of every adapter; 0 = LoRA off (full fine-tuning)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (peft's lora_alpha)
    dropout: float = 0.0  # on the adapter's input while training (peft's lora_dropout); never at sampling
    # HF module names of each decoder layer to adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    # (default: all of them; "LoRA without regret" found attention-only LoRA to lag, MLP LoRA to matter most).
    # megatron fuses q/k/v and gate/up into one linear each: those are adapted together or not at all there
    # (peft on the DeepSpeed learner adapts any subset).
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])


# learner.lr_decay: the schedule after the warm-up (megarl/learner/lr_schedule.py).
LR_DECAYS = ("constant", "linear", "cosine")


@dataclass
class LearnerConfig:
    backend: str = "megatron"  # megatron | deepspeed (any HF causal LM through transformers)
    tp: int = 1  # tensor-parallel ranks (each layer's weights split over them)
    pp: int = 1  # pipeline-parallel stages (the layers split over them)
    dp: int = 1  # data-parallel replicas; learner ranks = tp * pp * cp * dp
    # Context parallelism (megatron learner): each (packed) row's positions split over cp ranks, attention across
    # them by all-gathered keys and values; activations and the attention mask per rank ~1/cp (docs/learner.md).
    cp: int = 1
    # Expert parallelism (mixture-of-experts models): each expert-parallel rank holds num_experts / ep
    # whole experts; the ep ranks are carved out of the tensor-, context- and data-parallel ones (tp * cp * dp
    # must be a multiple of ep). An MoE model at tp > 1 trains with megatron's sequence parallelism (docs/moe.md).
    ep: int = 1
    micro_batch_size: int = 16  # most rows per micro-batch (rows are cut where least work: docs/learner.md)
    micro_batch_tokens: int = 0  # token budget per micro-batch (rows * longest row); 0 = none
    # Pack several rows into one row of the longest row's width (first-fit decreasing, a mask keeps each row to
    # itself): micro_batch_size then bounds the packed rows. Cuts the padding the model computes (docs/learner.md).
    pack_sequences: bool = True
    # With packing: rows that begin with the same tokens (a group's prompt, often its first completion tokens)
    # share those positions, computed once; each row still gets its own log-probs (docs/learner.md, "Prefix
    # sharing"). Not under algo.routing_replay=r3 (rows replay their own routes).
    share_prefixes: bool = True
    recompute_activations: str = "none"  # none | full | selective (megatron activation recomputation)
    lr: float = 1e-3  # the peak learning rate (AdamW)
    # The learning rate per optimizer step (megarl/learner/lr_schedule.py): a linear warm-up over lr_warmup_steps,
    # then lr_decay (constant | linear | cosine) down to lr * lr_min_ratio at lr_decay_steps (0 = the run's
    # optimizer steps: run.steps * algo.sync_epochs; megarl sft: its steps). The critic keeps algo.critic.lr.
    lr_warmup_steps: int = 0
    lr_decay: str = "constant"
    lr_decay_steps: int = 0
    lr_min_ratio: float = 0.0
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_beta1: float = 0.9  # AdamW beta1 (first-moment decay)
    adam_beta2: float = 0.999  # AdamW beta2 (second-moment decay)
    # AdamW epsilon (added to sqrt of the second moment): the first step moves a weight by lr * g / (|g| + eps), so a
    # gradient within a few eps of zero takes a step set by its rounding
    adam_eps: float = 1e-8
    grad_clip: float = 0.0  # clip the global gradient norm to this (0 = no clipping)
    use_distributed_optimizer: bool = False  # megatron: optimizer state sharded over the DP replicas
    # A step whose loss or grad norm is not finite is skipped (no update) and counted; this many in a
    # row stop the run with an error (the weights are not going to recover by themselves).
    max_nonfinite_in_row: int = 5
    seed: int = 1234  # seeds torch on the learner ranks (e.g. LoRA adapters' initialisation)
    threads: int = 1  # torch intra-op threads per learner process
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# algo.queue_order: the order a sampler sends its groups in (megarl/rollout/send_order.py).
QUEUE_ORDERS = ("deadline", "start", "finish")
# algo.stale: what the learner does with tokens more than algo.max_lag versions old (megarl/rollout/batch.py).
STALE_POLICIES = ("drop_group", "mask_tokens")


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
    # A token sampled by a version more than max_lag versions behind the learner is stale.
    max_lag: int = 4
    # What the learner does with stale tokens (pipeline mode; megarl/rollout/batch.py). "drop_group": drops every
    # group holding one, whole (a group's advantages are relative to each other; the sampler starts a replacement).
    # "mask_tokens": trains the group, its stale tokens given no policy gradient (loss.max_token_lag is set to
    # max_lag: they stay in the context and the normalisers, their reward in the group's baseline); only a group
    # with no fresh token is dropped. A long rollout spans many versions, so under drop_group the longest ones are
    # the ones lost; under mask_tokens they lose their oldest tokens, the beginning.
    stale: str = "drop_group"
    # The order in which a sampler sends its scored groups to the learner (megarl/rollout/send_order.py).
    # "deadline": as they finish, except that a group does not go ahead of an older, unfinished one that
    # would then reach the learner more than max_lag versions old; "start": in the order they were started;
    # "finish": as they finish (short groups overtake long ones, which may then be dropped as stale: the
    # trained batches lean towards short completions, benchmarks/stale_bias.py).
    queue_order: str = "deadline"
    # Mixture-of-experts models: "r3" (rollout routing replay) makes the learner route every token to the
    # experts the sampler's engine chose for it (recorded per token and layer); "off" lets it route itself.
    routing_replay: str = "off"
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    # The learned critic of advantage.estimator=gae (every field commented in megarl/algo/config.py).
    critic: CriticConfig = field(default_factory=CriticConfig)
    # On-policy distillation from a frozen teacher (teacher, coef, reward_weight; megarl/algo/distill.py): the
    # teacher scores every sampled token on the learner ranks; docs/algorithms.md#on-policy-distillation.
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class PublishConfig:
    bucket_mb: float = 16.0  # tensors are packed into flat buffers of at most this size
    timeout_s: float = 120.0  # one version's broadcast, end to end
    checksum: bool = True  # verify every bucket's checksum (publish.bucket_checksum) on the receiving side
    # Learner DP replicas that send (built-in engine): replica d broadcasts every k-th bucket over its own
    # group, so k sends run at once (docs/learner.md#several-senders measures when that pays).
    senders: int = 1
    # Wire dtype of floating tensors: float32, or bfloat16 (the learner keeps fp32 master weights; the engine
    # casts on arrival). delta: after the first publish, send per bucket only the words that changed.
    dtype: str = "float32"
    delta: bool = False


@dataclass
class QueueConfig:
    host: str = "127.0.0.1"  # the learner binds here; set to the node's address for multi-node
    timeout_s: float = 300.0  # the learner gives up when no sample arrives for this long
    # Largest message (one group) the learner reads; a longer one is dropped unread with its connection.
    # 0 = algo.group_size * sampler.max_seq_len * 128 bytes + 1 MiB (docs/security.md).
    max_message_mb: float = 0.0


@dataclass
class DistConfig:
    backend: str = "auto"  # "gloo", "nccl" or "auto" (nccl when CUDA is available)
    timeout_s: float = 600.0  # process-group creation and learner collectives


@dataclass
class CheckpointConfig:
    """Sharded, atomic learner checkpoints and the HF export (docs/checkpoint.md)."""

    dir: str = "${run.dir}/checkpoints"  # holds step_<N>/ directories and the `latest` pointer
    every_steps: int = 0  # save after every this many learner steps, and after the last one (0 = never)
    keep: int = 2  # the newest checkpoints kept; older ones are deleted after each save
    # Non-empty: at the end of training, save the final state and export it as an HF model directory here.
    export_dir: str = ""


@dataclass
class FaultConfig:
    """What happens when a process fails (docs/faults.md)."""

    # "auto": replace where max_sampler_restarts_per_hour >= 1 allows a replacement, else stop; `megarl train`
    # prints the policy in force, and the saved config.yaml holds it.
    # "stop": torchrun stops every process as soon as one fails; megarl names the failed rank and role.
    # "restart": torchrun restarts every process (at most max_restarts times) and the run resumes from
    # its last checkpoint (needs checkpoint.every_steps > 0); the lost progress is counted.
    # "replace": a sampler that dies or hangs is replaced while the learner trains on (a learner failure stops
    # the run); every engine, an engine spanning sampler.tp ranks replaced whole (docs/faults.md).
    on_failure: str = "auto"
    max_restarts: int = 3
    # Under on_failure=replace: replacements of one sampler (engine) in any hour; one more fails its rank (the run
    # stops).
    max_sampler_restarts_per_hour: int = 6
    # A sampler process that is alive but whose loop has not turned for this long is declared hung
    # (a dead one is torchrun's, or under on_failure=replace its keeper's, to see at once); the learner then fails,
    # naming it (under on_failure=replace it drops the sampler and its keeper replaces it).
    sampler_timeout_s: float = 300.0
    heartbeat_s: float = 1.0  # how often a sampler's loop reports that it turns
    # SIGTERM/SIGINT/SIGHUP stop the run at the next step boundary; also save a checkpoint there (a
    # checkpoint due by checkpoint.every_steps is saved anyway). docs/faults.md.
    checkpoint_on_signal: bool = False
    # After a stop signal, how long the processes may take to stop (finish the step, publish, checkpoint)
    # before torchrun kills them (its --shutdown-timeout).
    stop_timeout_s: int = 30


@dataclass
class SFTConfig:
    """`megarl sft CONFIG`: supervised fine-tuning on a JSONL file with the learner backends and layouts of
    `megarl train` (learner.*: backend, tp/pp/dp, ZeRO stage, micro-batches, optimizer betas, weight decay,
    grad clip), writing an HF model directory that `megarl train` takes as model.path (docs/sft.md)."""

    # The training records, one JSON object per line: {"prompt": ..., "completion": ...} (loss on the
    # completion's tokens and the tokenizer's EOS) or {"messages": [{"role": ..., "content": ...}, ...]}
    # (rendered with the model directory's chat template; loss on the assistant turns). Other keys are ignored.
    data: str = ""
    # Held-out records (same formats), or "" to hold out `eval_fraction` of `data` (drawn with run.seed).
    eval_data: str = ""
    eval_fraction: float = 0.05
    eval_every: int = 0  # held-out loss every this many steps; 0: before the first and after the last only
    epochs: float = 1.0  # passes over the training records: steps = ceil(epochs * records / batch_size)
    steps: int = 0  # optimizer steps; > 0 replaces `epochs`
    batch_size: int = 32  # records per optimizer step; the loss is the token mean over the batch's trained tokens
    lr: float = 1e-4  # the peak lr (learner.lr is RL's); learner.lr_* schedule it, decaying over the SFT steps
    max_seq_len: int = 0  # tokens per record (prompt + completion); 0 = the model's max_position_embeddings
    # A record longer than max_seq_len: "error" (stops before training, naming file:line) or "skip" (counted).
    on_overlong: str = "error"
    # A line that is empty, not JSON, or not a record of either format: "error" (file:line) or "skip" (counted).
    on_bad_row: str = "error"
    output_dir: str = "${run.dir}/model"  # the HF model directory written at the end (run.overwrite replaces one)


@dataclass
class EvalSetConfig:
    """One held-out set (docs/eval.md)."""

    name: str = "heldout"  # the metric prefix: eval/<name>/pass@1, ...
    # "" = held-out prompts of the training task (task.*; eval.heldout_fraction of them, never trained
    # on), drawn with eval.seed from their own stream; else a .jsonl file of {"prompt", "answer"} rows
    # (task.prompt_field / task.answer_field), scored like task.name=jsonl.
    path: str = ""
    prompts: int = 64  # prompts in the set (a file: its first rows; 0 = all of them)
    reward_fn: str = ""  # "" = task.reward_fn (or the task's own reward); else "package.module:function"


@dataclass
class EvalConfig:
    """Held-out evaluation while training, every score of exactly one policy version (docs/eval.md);
    `megarl eval CONFIG` scores a model with the same keys. A multi-turn task's (task.name=tool_arith) eval
    samples are whole episodes (task.max_turns etc. apply), scored by the episode's final reward."""

    sets: list[EvalSetConfig] = field(default_factory=list)  # empty: no evaluation
    samples: int = 4  # sampled completions per prompt (n of pass@k)
    k: int = 4  # pass@1 and pass@k are reported; k <= samples
    temperature: float = 1.0  # of the sampled completions (top_p 1, top_k off)
    greedy: bool = True  # one greedy (temperature 0) completion per prompt too: the "greedy" score
    max_new_tokens: int = 0  # per completion (an episode: per model turn); 0 = sampling.max_new_tokens
    every_steps: int = 0  # evaluate the version published every this many steps; 0 = never in between
    at_start: bool = True  # the version training starts from (the base model: version 0; a resumed run's)
    at_end: bool = True  # the last version (published by step run.steps)
    seed: int = 0  # draws the sets' prompts and seeds the eval sampling (the same in `megarl eval`)
    # The share of the training task's prompts (by a hash of the text: megarl/rollout/heldout.py) held out:
    # sets with an empty path draw only these, and a run with such a set never trains on them.
    heldout_fraction: float = 0.1
    max_running: int = 0  # sequences decoded at once in an evaluation; 0 = sampler.max_running
    timeout_s: float = 600.0  # at the end, how long the learner waits for the last evaluations' results


# observe.trackers: where a run's scalars, evaluation curves and config go besides metrics.jsonl.
TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass
class ObserveConfig:
    """Run trackers (megarl/observe/trackers.py): each gets every learner step's scalars and every evaluation's,
    as metrics.jsonl holds them, and the run's resolved config; they log off the learner's step path.
    wandb and mlflow need `pip install "megarl[trackers]"`; `megarl train` refuses a tracker that cannot start."""

    # Any of tensorboard (run.dir/tensorboard/), wandb, mlflow; [] = metrics.jsonl only.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    run_name: str = ""  # the run's name in wandb and MLflow; "" = the name of run.dir
    wandb_project: str = "megarl"  # the wandb project the run goes to
    wandb_entity: str = ""  # "" = wandb's default entity (of the logged-in user)
    # "online", "offline" (files only: `wandb sync` uploads them later) or "disabled"; "" = WANDB_MODE or online.
    wandb_mode: str = ""
    wandb_dir: str = "${run.dir}"  # wandb writes its wandb/ folder (run files, offline runs) here
    # "" = a file store in run.dir/mlruns (`mlflow ui --backend-store-uri` it); else http(s)://host, sqlite:///...
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "megarl"  # the MLflow experiment the run goes to (made when missing)
    close_timeout_s: float = 120.0  # at the end, how long a tracker may take to write what is queued


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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)  # megarl sft only
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation (train and megarl eval)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
