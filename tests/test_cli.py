"""`megarl train` refuses what the workers could not run before any process starts, naming the path and what
is wrong; `megarl placement` says which node runs which roles. The real CLI, in a subprocess."""
import json
import tempfile
from pathlib import Path

import pytest

from tests.helpers import REPO, run_python, save_tokenizer

DEMO = str(REPO / "configs" / "demo.yaml")
EMPTY_RUN_DIR = tempfile.mkdtemp(prefix="megarl-cli-test-")  # a dry run writes nothing there
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu"}


def model_dir(root: Path, config=QWEN2, files=("model.safetensors", "tokenizer.json"), tokenizer: str | None = None
              ) -> Path:
    """An HF-format model directory as far as the start-up checks look (nothing loads the weights here); the
    tokenizer files load (a tokenizer.json is a real one, or `tokenizer`, its text, when given)."""
    root.mkdir()
    if config is not None:
        (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name in files:
        (root / name).write_text({"vocab.json": '{"a": 0, "b": 1}', "merges.txt": "#version: 0.2\n"}.get(name, "{}"))
    if "tokenizer.json" in files:
        save_tokenizer(root)
        if tokenizer is not None:
            (root / "tokenizer.json").write_text(tokenizer)
    return root


def train(*args: str):
    """`megarl train --dry-run`, in an empty run.dir unless `args` name one (the default, runs/demo, may
    hold a demo run's outputs, which a fresh run refuses)."""
    run_dir = [] if any(a.startswith("run.dir=") for a in args) else [f"run.dir={EMPTY_RUN_DIR}"]
    return run_python("-m", "megarl.cli", "train", DEMO, *run_dir, *args, "--dry-run", timeout=120)


BROKEN_MODELS = {
    "not a directory": (None, None, "is not a directory"),
    "no config.json": (None, ("model.safetensors",), "has no config.json"),
    "config.json not JSON": ("{model_type: qwen2", ("model.safetensors", "tokenizer.json"), "config.json is not valid JSON"),
    "unsupported model_type": ({**QWEN2, "model_type": "gpt2"}, ("model.safetensors", "tokenizer.json"),
                               "config.json: unsupported model_type 'gpt2'"),
    "unsupported architecture": ({**QWEN2, "architectures": ["Qwen2MoeForCausalLM"]},
                                 ("model.safetensors", "tokenizer.json"), "unsupported architecture 'Qwen2MoeForCausalLM'"),
    "no weights": (QWEN2, ("tokenizer.json",), "has no weights (model.safetensors or model.safetensors.index.json)"),
    "no tokenizer": (QWEN2, ("model.safetensors", "tokenizer_config.json"),
                     "has no tokenizer files (one of: tokenizer.json; vocab.json + merges.txt; tokenizer.model)"),
    # Valid JSON that transformers cannot load: the sampler died 40 s after the launch with KeyError: 'added_tokens'.
    "corrupt tokenizer.json": (QWEN2, ("model.safetensors", "tokenizer.json"), "/model/tokenizer.json: the tokenizer "
                               "does not load (transformers AutoTokenizer, as the workers load it): KeyError: 'added_tokens'"),
    "truncated tokenizer.json": (QWEN2, ("model.safetensors", "tokenizer.json"),
                                 "/model/tokenizer.json: the tokenizer does not load (transformers AutoTokenizer, as the "
                                 "workers load it): JSONDecodeError: "),
}
BROKEN_TOKENIZERS = {"corrupt tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
                     "truncated tokenizer.json": '{"version": "1.0", "added_tokens": [{"id'}


@pytest.mark.parametrize("case", list(BROKEN_MODELS))
def test_a_broken_model_directory_is_named_before_any_worker_starts(case, tmp_path):
    config, files, message = BROKEN_MODELS[case]
    path = (tmp_path / "model" if case == "not a directory" else
            model_dir(tmp_path / "model", config, files, BROKEN_TOKENIZERS.get(case)))
    proc = train(f"model.path={path}")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert proc.stderr.startswith("megarl: model.path: ") and message in proc.stderr and str(path) in proc.stderr


def test_tokenizers_that_load_but_do_not_fit_the_model_are_named(tmp_path):
    """Ids beyond the embedding failed after the launch; a tokenizer mapping every token to one id trained
    silently at reward 0."""
    short = model_dir(tmp_path / "short", {**QWEN2, "vocab_size": 100})
    proc = train(f"model.path={short}")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert proc.stderr.startswith(f"megarl: model.path: {short}/tokenizer.json: the tokenizer has ids up to 263 "
                                  f"('<|reserved_5|>') but config.json's vocab_size=100"), proc.stderr
    one_id = model_dir(tmp_path / "one_id")
    tokenizer = json.loads((one_id / "tokenizer.json").read_text())
    tokenizer["model"].update(vocab={token: 5 for token in tokenizer["model"]["vocab"]}, merges=[])
    (one_id / "tokenizer.json").write_text(json.dumps(tokenizer))
    proc = train(f"model.path={one_id}")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert proc.stderr.startswith(f"megarl: model.path: {one_id}/tokenizer.json: the tokenizer is degenerate: its "
                                  f"256 tokens, decoded and encoded again, all become [5]"), proc.stderr


def test_a_kv_cache_larger_than_the_machine_is_refused_before_launch(tmp_path):
    """It failed after the launch, asking for 32 TB."""
    config = {**QWEN2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    path = model_dir(tmp_path / "model", config)
    proc = train(f"model.path={path}", "sampler.max_seq_len=1000000000", "sampler.max_running=8",
                 "sampling.max_new_tokens=8")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    # 2 (K, V) x 4 bytes x 2 layers x 2 KV heads x 16 head dims x 8 requests x 1e9 positions = 3,814.7 GiB
    assert proc.stderr.startswith(f"megarl: model.path: {path}/config.json: sampler.max_seq_len=1000000000: the "
                                  f"built-in engine's KV cache for sampler.max_running=8 requests of that length "
                                  f"would take 3,814.7 GiB, more than this machine's "), proc.stderr


def test_a_run_dir_that_is_a_file_is_refused_before_launch(tmp_path):
    # Past the checks it would fail inside torchrun: FileExistsError, a 30 s shutdown wait, exit 1.
    (tmp_path / "f").write_text("x")
    proc = train(f"run.dir={tmp_path / 'f'}")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert proc.stderr == f"megarl: run.dir {tmp_path / 'f'} is a file, not a directory; set run.dir to a directory\n"


def test_an_lr_decay_that_would_end_before_its_warmup_is_refused_before_launch():
    """learner.lr_decay_steps=0 spans the run's optimizer steps (run.steps * algo.sync_epochs): 3 * 2 = 6 here."""
    proc = train("run.steps=3", "algo.mode=sync", "algo.sync_epochs=2", "learner.lr_decay=cosine",
                 "learner.lr_warmup_steps=6")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert proc.stderr == ("megarl: config error: learner.lr_decay=cosine needs learner.lr_decay_steps (0: the run's 6 "
                           "optimizer steps) > learner.lr_warmup_steps (6): the decay starts where the warm-up ends\n")


def test_a_model_that_the_tensor_parallel_size_does_not_split_is_named(tmp_path):
    config = {**QWEN2, "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 64}
    path = model_dir(tmp_path / "model", config)
    proc = train(f"model.path={path}", "learner.tp=2", "sampler.tp=2", "eval.sets=[]")
    assert proc.returncode == 2
    assert "learner.tp/sampler.tp=2: tensor parallel size 2 does not divide num_key_value_heads=1" in proc.stderr


def test_gpt_oss_r3_launches_on_the_native_engine_and_is_refused_on_its_generic_model_and_a_clamp_vllm_ignores(
        tmp_path):
    """gpt-oss samples on the built-in engine's native forward, which records its routes: algo.routing_replay=r3
    launches. Forced onto the generic model (sampler.model_impl=hf), which records none, r3 is named before launch;
    so is sampler.engine=vllm with a swiglu_limit vLLM would not apply. An MXFP4 checkpoint launches (megarl's loader
    dequantizes it), and with the DeepSpeed learner, whose transformers loader would not, it is named before launch."""
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_act": "silu",
              "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2,
              "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True,
              "vocab_size": 264, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
    path = model_dir(tmp_path / "model", config)
    proc = train(f"model.path={path}", "algo.routing_replay=r3", "sampler.model_impl=hf", "eval.sets=[]")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert ("algo.routing_replay=r3: the built-in engine samples model_type 'gpt_oss' on its generic model"
            in proc.stderr)
    mxfp4 = model_dir(tmp_path / "model_mxfp4", {**config, "quantization_config": {"quant_method": "mxfp4"}})
    proc = train(f"model.path={mxfp4}", "algo.routing_replay=r3", "eval.sets=[]")
    assert proc.returncode == 0, proc.stderr
    proc = train(f"model.path={mxfp4}", "learner.backend=deepspeed", "eval.sets=[]")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert "learner.backend=deepspeed: an MXFP4 checkpoint (quantization_config mxfp4)" in proc.stderr
    # vLLM clamps gpt-oss's SwiGLU at 7.0 whatever the config says: another limit is named before launch
    path = model_dir(tmp_path / "model_limit", {**config, "swiglu_limit": 2.0})
    proc = train(f"model.path={path}", "sampler.engine=vllm", "eval.sets=[]")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert "vLLM 0.32 clamps gpt-oss's SwiGLU at 7.0 and ignores swiglu_limit=2.0" in proc.stderr


def test_deepseek_v3_on_vllm_is_refused_before_launch_unless_the_cpu_kernel_serves_its_latent_and_router():
    """vLLM 0.32's CPU MLA kernel fails at the first request on a latent other than 512 + 64 RoPE dims, and its
    loader reads the router bias only under topk_method noaux_tc: both are named before launch; the built-in engine
    is not concerned."""
    from megarl.cli import check_vllm_model
    from megarl.config.load import load_config

    vllm = load_config(None, ["sampler.engine=vllm"], check_files=False)
    served = {"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "topk_method": "noaux_tc"}
    check_vllm_model(served, vllm)
    with pytest.raises(ValueError, match="config.json has kv_lora_rank=16, qk_rope_head_dim=64 .*sampler.engine=builtin"):
        check_vllm_model({**served, "kv_lora_rank": 16}, vllm)
    with pytest.raises(ValueError, match="topk_method: noaux_tc, and config.json has topk_method='greedy'"):
        check_vllm_model({**served, "topk_method": "greedy"}, vllm)
    check_vllm_model({**served, "kv_lora_rank": 16}, load_config(None, [], check_files=False))


def test_a_model_real_sglang_would_load_wrongly_is_refused_before_launch_and_the_stand_in_is_not_concerned(tmp_path):
    """A tied Qwen3-MoE (SGLang's class never ties its lm_head) on sampler.sglang.server=sglang: named before launch
    (sampler.sglang_engine.check_sglang_serves, shown on SGLang's own code by its family loads); megarl's stand-in
    server ties as transformers does and launches."""
    from tests.sampler import make_tiny_model

    path = make_tiny_model(tmp_path / "model", "qwen3_moe")  # tied, as tests.sampler.TIED says
    proc = train(f"model.path={path}", "sampler.engine=sglang", "sampler.sglang.server=sglang", "eval.sets=[]")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert "SGLang's qwen3_moe model never ties its lm_head" in proc.stderr and "tie_word_embeddings: true" in proc.stderr
    from megarl.cli import check_sglang_model
    from megarl.config.load import load_config

    tied = json.loads((path / "config.json").read_text())
    for stand_in in (["sampler.engine=sglang"], []):  # megarl's stand-in server, the built-in engine
        check_sglang_model(tied, load_config(None, stand_in, check_files=False))


def test_deepseek_v3_r3_launches_on_the_native_engine_with_either_kv_layout_and_sampler_tp(tmp_path):
    """DeepSeek-V3 samples on the built-in engine's native forward, which records its routes: algo.routing_replay=r3
    launches, and so do its latent cache in the paged KV layout and an engine over two TP ranks."""
    from tests.helpers import DEEPSEEK_V3_ROPE, GLM4_MOE_ROUTER

    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_act": "silu",
              "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
              "vocab_size": 264, "max_position_embeddings": 64, "intermediate_size": 48, "moe_intermediate_size": 16,
              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
              "first_k_dense_replace": 1, "q_lora_rank": 12, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_interleave": True, "rms_norm_eps": 1e-6,
              "rope_parameters": dict(DEEPSEEK_V3_ROPE), **GLM4_MOE_ROUTER}
    path = model_dir(tmp_path / "model", config)
    proc = train(f"model.path={path}", "algo.routing_replay=r3", "eval.sets=[]")
    assert proc.returncode == 0, proc.stderr
    proc = train(f"model.path={path}", "sampler.kv_layout=paged", "sampler.tp=2", "eval.sets=[]")
    assert proc.returncode == 0, proc.stderr


def test_a_model_directory_with_a_slow_tokenizer_passes(tmp_path):
    path = model_dir(tmp_path / "model", files=("model.safetensors", "vocab.json", "merges.txt"))
    proc = train(f"model.path={path}")
    assert proc.returncode == 0, proc.stderr
    assert f"megarl: model {path}; run dir {EMPTY_RUN_DIR}" in proc.stdout and "would launch: torchrun" in proc.stdout


def test_a_dry_run_prints_the_resolved_config_and_launches_nothing():
    proc = train("run.steps=7", "algo.group_size=4")
    assert proc.returncode == 0, proc.stderr
    assert "megarl: dry run; the resolved config:\nrun:\n" in proc.stdout
    assert "\n  steps: 7\n" in proc.stdout and "\n  group_size: 4\n" in proc.stdout and "\n  lr: " in proc.stdout
    assert "megarl: launching" not in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("megarl: dry run, would launch: torchrun ")


@pytest.mark.parametrize("overrides, message", [
    (["task.name=nope"], "megarl: task: unknown task 'nope'; known tasks: "
                         "['arithmetic', 'count', 'jsonl', 'lap_count', 'python_output', 'tool_arith']"),
    (["task.reward_fn=tests.rollout.nope:fn"], "cannot import module 'tests.rollout.nope'"),
    (["task.reward_fn=tests.rollout.reward_fns:nope"], "has no attribute 'nope'"),
    (["task.name=jsonl", "task.path=DATA"], "megarl: task: DATA:2: missing field 'answer'"),
])
def test_a_task_that_cannot_run_is_named_before_any_worker_starts(overrides, message, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n')
    path = model_dir(tmp_path / "model")
    proc = train(f"model.path={path}", *[o.replace("DATA", str(data)) for o in overrides])
    assert proc.returncode == 2 and message.replace("DATA", str(data)) in proc.stderr, proc.stderr


def test_skipped_dataset_rows_are_counted_at_start(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\nnot json\n')
    proc = train(f"model.path={model_dir(tmp_path / 'model')}", "task.name=jsonl", f"task.path={data}",
                 "task.on_bad_row=skip", "eval.sets=[]")  # one prompt: nothing to hold out
    assert proc.returncode == 0, proc.stderr
    assert f"megarl: dataset {data}: 1 prompts, 2 bad rows skipped (first: {data}:2: missing field 'answer'" in proc.stdout


def test_placement_prints_each_node_and_refuses_an_uneven_split():
    proc = run_python("-m", "megarl.cli", "placement", DEMO, "learner.tp=2", "sampler.num_engines=2", "--nnodes", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "4 processes = 2 learner ranks (learner.tp*pp*cp*dp) + 2 sampler ranks (sampler.num_engines*tp), 2 on each of 2 nodes",
        "node 0 (torchrun group rank 0): rank 0 = learner 0 (publishes weights, binds the queue at queue.host, "
        "writes run.dir); rank 1 = learner 1",
        "node 1 (torchrun group rank 1): rank 2 = sampler 0; rank 3 = sampler 1"]
    proc = run_python("-m", "megarl.cli", "placement", DEMO, "learner.tp=2", "sampler.tp=2", "eval.sets=[]", "--nnodes", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ("node 1 (torchrun group rank 1): rank 2 = sampler 0 (engine 0 TP rank 0); "
                                            "rank 3 = sampler 1 (engine 0 TP rank 1)")
    proc = run_python("-m", "megarl.cli", "placement", DEMO, "sampler.num_engines=2", "--nnodes", "2")
    assert proc.returncode == 2
    assert "the config needs 3 processes, which 2 nodes x 1 processes per node do not give" in proc.stderr
    proc = run_python("-m", "megarl.cli", "train", DEMO, "--nnodes", "2")
    assert proc.returncode == 2 and "launch/torchrun_multi_node.sh" in proc.stderr


def torchrun_report(root_cause: tuple[int, int], others: list[tuple[int, int]]) -> str:
    """torchrun's ChildFailedError report, as it prints it (ranks' exit codes; negative = signal)."""
    def entry(index, rank, code):
        return (f"[{index}]:\n  time      : 2026-11-30_00:55:32\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {100 + rank})\n"
                f"  error_file: <N/A>\n")
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\nworker FAILED\n-----\n"
            "Failures:\n" + "".join(entry(i + 1, r, c) for i, (r, c) in enumerate(others))
            + "-----\nRoot Cause (first observed failure):\n" + entry(0, *root_cause) + "=====\n")


@pytest.mark.parametrize("root_cause, others, named", [
    # torchrun saw the learner's error first, but the sampler was killed from outside: that is the cause.
    ((0, 1), [(1, -9)], "sampler 0 (rank 1) was killed by signal 9 (SIGKILL)"),
    # SIGTERM is torchrun stopping the others: the root cause stands.
    ((2, -6), [(0, -15), (1, -15)], "sampler 1 (rank 2) was killed by signal 6 (SIGABRT)"),
    ((0, 1), [(1, -15), (2, -15)], "learner 0 (rank 0) exited with code 1 (its traceback is above)"),
])
def test_the_failure_summary_names_the_rank_that_caused_the_stop(root_cause, others, named):
    from megarl.cli import failure_summary
    from megarl.config.load import load_config

    cfg = load_config(DEMO, ["sampler.num_engines=2"])
    summary = failure_summary("worker log lines\n" + torchrun_report(root_cause, others), cfg)
    assert summary.startswith(named + "; torchrun stopped every other process")
    assert failure_summary("no report at all", cfg) == "torchrun exited with an error (see its output above)"


def test_under_replace_a_sampler_rank_that_ran_out_of_restarts_is_named_and_nothing_restarted():
    # fault.on_failure=replace: a sampler's keeper fails only past fault.max_sampler_restarts_per_hour; torchrun
    # then stops every other process (it restarts nothing: --max-restarts 0).
    from megarl.cli import failure_summary
    from megarl.config.load import load_config

    cfg = load_config(DEMO, ["sampler.num_engines=2", "fault.on_failure=replace", "eval.sets=[]"])
    summary = failure_summary(torchrun_report((2, 1), [(0, -15), (1, -15)]), cfg)
    assert summary.startswith("sampler 1 (rank 2) exited with code 1 (its traceback is above); "
                              "torchrun stopped every other process."), summary


def test_a_run_dir_holding_another_runs_outputs_is_refused_before_launch(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    model = model_dir(tmp_path / "model")
    proc = train(f"model.path={model}", f"run.dir={run_dir}")
    assert proc.returncode == 2 and "launching" not in proc.stdout
    assert proc.stderr.startswith(f"megarl: checkpoint: run.dir {run_dir} already holds another run's outputs "
                                  f"(metrics.jsonl)"), proc.stderr
    assert "choose a new run.dir, or set run.overwrite=true to delete those outputs first" in proc.stderr
    proc = train(f"model.path={model}", f"run.dir={run_dir}", "run.overwrite=true")
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "metrics.jsonl").exists()  # the learner deletes them once launched, not a dry run


def hung_sampler_stderr(report: str) -> str:
    """What torchrun printed when a SIGSTOP'd sampler (rank 1) made the learner fail (recorded from a real run,
    shortened): the learner's error, torchrun's SIGTERM, which the stopped sampler cannot take, and the SIGKILL
    torchrun escalates to 30 s later."""
    return ("TimeoutError: weight publish: version 19 bucket 1/1 failed or timed out after 8s (a sampler or the "
            "learner may have died): [gloo] Timed out waiting 8000ms for send operation to complete; sampler rank 1 "
            "(sampler 0) has sent no heartbeat for 8s\n"
            "W1201 19:34:59.692000 14764 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 101 "
            "closing signal SIGTERM\n"
            "W1201 19:35:29.692000 14764 torch/distributed/elastic/multiprocessing/api.py:1047] Unable to shutdown "
            "process 101 via 15, forcefully exiting via 9\n" + report)


@pytest.mark.parametrize("stderr, named", [
    # The SIGKILL is torchrun's own escalation for a process that could not take SIGTERM: the cause is the hang.
    (hung_sampler_stderr(torchrun_report((0, 1), [(1, -9)])),
     "sampler 0 (rank 1) hung: alive but silent, no heartbeat for 8s, so learner 0 (rank 0) stopped the run"),
    # A megarl worker takes torchrun's SIGTERM and exits 128 + 15: torchrun's stop, not the cause...
    (torchrun_report((1, 143), [(0, 1)]), "learner 0 (rank 0) exited with code 1 (its traceback is above)"),
    # ... unless a stop signal is all there was (`kill` of one worker of a raw torchrun launch).
    (torchrun_report((1, 143), [(0, 143)]), "sampler 0 (rank 1) stopped on SIGTERM (exit code 143)"),
])
def test_the_failure_summary_tells_torchruns_own_stops_from_the_cause(stderr, named):
    from megarl.cli import failure_summary
    from megarl.config.load import load_config

    assert failure_summary(stderr, load_config(DEMO, [])).startswith(named)


def test_key_value_overrides_are_taken_anywhere_also_after_an_option():
    from megarl.cli import build_parser, parse_command_line

    parser = build_parser()
    args = parse_command_line(parser, ["eval", "c.yaml", "a=1", "--checkpoint", "runs/x", "b=2", "--out", "o.json",
                                       "c=3"])
    assert (args.overrides, args.checkpoint, args.out) == (["a=1", "b=2", "c=3"], "runs/x", "o.json")
    assert parse_command_line(parser, ["train", "c.yaml", "--dry-run", "a=1"]).overrides == ["a=1"]
    for argv in (["eval", "c.yaml", "--checkpoint", "x", "stray"], ["export", "--checkpoint", "x", "--out", "y", "a=1"]):
        with pytest.raises(SystemExit):
            parse_command_line(parser, argv)


def test_a_tokenizer_check_that_passed_is_remembered_by_the_files_it_read(tmp_path):
    """Loading the tokenizer imports transformers (~2 CPU-s of the CLI, on the cores its ranks start on): a pass is
    remembered under the files' bytes, so the same model checks again without transformers; a changed file is
    checked again, and a refusal is never remembered."""
    path = model_dir(tmp_path / "model")
    memo = tmp_path / "cache" / ".check-memo.json"
    child = ("import sys; from pathlib import Path; from megarl.cli import check_tokenizer; "
             f"check_tokenizer(Path({str(path)!r}), ('tokenizer.json',), 264, Path({str(memo)!r})); "
             "print('transformers' in sys.modules)")

    def check() -> str:
        proc = run_python("-c", child, timeout=120)
        return proc.stdout.strip() if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]

    assert check() == "True"  # checked: transformers loaded the tokenizer
    assert check() == "False"  # the same files: remembered
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["model"].update(vocab={token: 5 for token in tokenizer["model"]["vocab"]}, merges=[])
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    for _ in range(2):  # a changed file is loaded again, and its refusal is not remembered
        assert check().startswith(f"ValueError: {path}/tokenizer.json: the tokenizer is degenerate")
