"""End to end: `megarl train` and the raw torchrun command run the whole data path for real
(two processes, gloo, ZeroMQ, megatron learner, built-in engine) and leave complete run outputs."""
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from megarl.observe.sinks import eval_records, train_records
from tests.helpers import REPO, run_python, run_torchrun

DEMO = str(REPO / "configs" / "demo.yaml")
STEPS = 8
EVAL_EVERY = 4  # the demo's held-out set at versions 0, 4 and 8 (docs/eval.md)
# DAPO's overlong shaping rides along in the demo run (test_overlong_shaping_...): it changes the advantages only,
# which nothing else here checks. The demo's limit is 49 tokens: a ramp from 5 tokens.
OVERLONG_BUFFER, OVERLONG_PENALTY = 44, 0.5


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def demo_run(embedded_count_model_dir, tmp_path_factory):
    """(the finished `megarl train` of the demo for STEPS steps, its run.dir): one launch for the tests that read it."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    proc = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", f"run.steps={STEPS}",
                      f"model.path={embedded_count_model_dir}", f"eval.every_steps={EVAL_EVERY}",
                      f"algo.advantage.overlong_buffer={OVERLONG_BUFFER}",
                      f"algo.advantage.overlong_penalty={OVERLONG_PENALTY}", timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, run_dir


def test_megarl_train_runs_pipeline_rl_and_writes_every_output(embedded_count_model_dir, demo_run):
    proc, run_dir = demo_run
    assert f"step {STEPS}/{STEPS}" in proc.stdout  # the console progress line
    assert "megarl: eval version 0 (step 0" in proc.stdout and "megarl: eval heldout: pass@1" in proc.stdout
    assert "megarl: policy entropy " in proc.stdout  # the summary's first -> last tenth of entropy/mean

    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.run.steps == STEPS and cfg.model.path == str(embedded_count_model_dir)
    max_lag, per_step = cfg.algo.max_lag, cfg.algo.prompts_per_step * cfg.algo.group_size

    metrics = train_records(read_jsonl(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))  # one optimizer step per batch
    for m in metrics:
        for key in ("reward_mean", "lag_mean", "lag_max", "tokens_per_s", "loss", "ratio/mean", "ess", "entropy/mean"):
            assert math.isfinite(m[key]), key
        assert 0 <= m["lag_mean"] <= m["lag_max"] <= max_lag
        assert 0 < m["sampler1/busy_frac"] <= 1 and m["sampler1/tokens_decoded"] > 0  # sampler rank 1's counters
    # Learner and sampler compute the same policy: step 0 trains only on version-0 tokens, and the
    # learner's log-probs equal the recorded behaviour log-probs. (Later lag-0 tokens may come from
    # rollouts that crossed an update with their old KV cache kept, whose behaviour log-probs are
    # legitimately not the learner's: tests/roles below check the publish path with max_lag=0.)
    assert metrics[0]["lag0/token_share"] == 1.0
    assert metrics[0]["lag0/logprob_gap_abs"] < 1e-4

    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    assert len(rollouts) == STEPS * per_step
    for r in rollouts:
        n = len(r["token_ids"])
        assert n > 0 and len(r["versions"]) == n and len(r["behaviour_logprobs"]) == n
        assert r["versions"] == sorted(r["versions"])  # versions never decrease within a rollout
        assert r["trained_at_step"] - min(r["versions"]) <= max_lag
        assert max(r["versions"]) <= r["trained_at_step"]
        assert r["reward"] in (0.0, 1.0) and r["prompt"] and isinstance(r["completion"], str)
    assert sorted({r["trained_at_step"] for r in rollouts}) == list(range(STEPS))
    # algo.queue_order=deadline (the default): no group overtakes an older one that would then arrive stale, so
    # none is dropped (with "finish" the demo drops groups from its fourth step on), evaluations included.
    assert metrics[-1]["dropped/stale_groups_total"] == 0
    assert all(m["sampler1/held_groups"] >= 0 for m in metrics)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward_mean", "lag_mean", "ratio/mean", "ess", "lag0/ratio_mean", "lag0/token_share"} <= tags
    assert len(events.Scalars("reward_mean")) == STEPS
    from megarl.observe.timeline import load_startup, load_timeline

    timeline = load_timeline(run_dir)
    assert {e["kind"] for e in timeline["learner0"]} == {"wait", "train", "publish"}
    # Each process's start-up, part by part, ends before its first step (benchmarks/vs_trl.py's breakdown).
    startup = load_startup(run_dir)
    assert [e["kind"] for e in startup["learner0"]] == [f"startup:{part}" for part in (
        # the ranks import their roles' libraries while `megarl train` checks, then wait for its go
        "python, imports", "config", "store (rendezvous)", "role imports", "launch gate (the CLI's checks)",
        "model path", "learner group", "publish groups", "model build", "intake")]
    assert startup["sampler1"][-1]["kind"] == "startup:engine, then the learner's announcement"
    for name, first_event in (("learner0", timeline["learner0"][0]), ("sampler1", timeline["sampler1"][0])):
        spans = startup[name]
        assert all(a["end"] == b["start"] and a["start"] <= a["end"] for a, b in zip(spans, spans[1:]))
        assert spans[-1]["end"] <= first_event["start"]
    assert len([e for e in timeline["learner0"] if e["kind"] == "train"]) == STEPS
    assert sum(e["tokens"] for e in timeline["sampler1"]) >= sum(len(r["token_ids"]) for r in read_jsonl(
        run_dir / "rollouts.jsonl"))  # the sampler decoded at least every trained token

    # Behaviour log-probs of version-0 rollouts equal an independent recomputation (HF transformers)
    # with the version-0 weights on disk.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_count_model_dir, dtype=torch.float32).eval()
    v0 = [r for r in rollouts if set(r["versions"]) == {0}][:32]
    assert v0
    worst = 0.0
    with torch.no_grad():
        for r in v0:
            ids = torch.tensor([r["prompt_ids"] + r["token_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double() / cfg.sampling.temperature, -1)
            p = len(r["prompt_ids"])
            ref = logp[p - 1:, :].gather(1, ids[0, p:, None]).squeeze(1)
            worst = max(worst, (ref - torch.tensor(r["behaviour_logprobs"], dtype=torch.float64)).abs().max().item())
    assert worst < 1e-4
    check_evaluations(run_dir, embedded_count_model_dir, events)


def check_evaluations(run_dir: Path, model_dir: Path, events) -> None:
    """The demo's evaluations: one eval record per due version; every token of every eval sample of the
    version the score is labelled with (publishes landed meanwhile: they stayed staged); the scores of
    version 0 equal `megarl eval` on the base model with the same seeds, sample for sample."""
    from megarl.config.load import load_config
    from megarl.eval.standalone import evaluate_model

    evals = eval_records(read_jsonl(run_dir / "metrics.jsonl"))
    assert [(e["eval_version"], e["step"]) for e in evals] == [(v, v) for v in range(0, STEPS + 1, EVAL_EVERY)]
    for e in evals:
        assert 0 <= e["eval/heldout/pass@1"] <= e["eval/heldout/pass@4"] <= 1 and e["eval/heldout/prompts"] == 64
        assert e["eval/heldout/pass@1"] == e["eval/heldout/reward_mean"]  # exact-match rewards are 0 or 1
        assert 0 <= e["eval/heldout/greedy"] <= 1 and e["eval/heldout/completion_len_mean"] > 0
    samples = read_jsonl(run_dir / "eval_samples.jsonl")
    assert len(samples) == len(evals) * 64 * (4 + 1)
    for r in samples:
        assert r["versions"] and set(r["versions"]) == {r["eval_version"]}, (r["eval_version"], r["versions"])
    assert {"eval/heldout/pass@4", "eval/heldout/greedy"} <= set(events.Tags()["scalars"])
    # The held-out split: no eval prompt was ever a training prompt (megarl/rollout/heldout.py).
    assert not {r["prompt"] for r in samples} & {r["prompt"] for r in read_jsonl(run_dir / "rollouts.jsonl")}
    standalone = evaluate_model(load_config(DEMO, [f"model.path={model_dir}"]), model_dir)
    in_run = [{k: v for k, v in r.items() if k not in ("eval_version", "share")} for r in samples
              if r["eval_version"] == 0]
    assert in_run == standalone["records"]
    assert {k: v for k, v in standalone["metrics"].items() if k != "eval_s"} == \
        {k: v for k, v in evals[0].items() if k.startswith("eval/") and k != "eval/publishes_during"}


def test_groups_dropped_for_zero_variance_free_the_samplers_budget_before_the_next_publish(
        embedded_count_model_dir, tmp_path):
    """With advantage.filter_zero_variance, 7 groups in 8 are dropped: more than the staleness budget
    holds. The sampler learns of each drop at once and starts replacements (hearing of drops only with the
    next publish, which needs those groups, would stand the run still until queue.timeout_s). With
    algo.queue_order=finish: each group is sent as soon as it is scored."""
    run_dir = tmp_path / "filtered"
    proc = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", "run.steps=3",
                      f"model.path={embedded_count_model_dir}", "algo.advantage.filter_zero_variance=true",
                      "algo.prompts_per_step=4", "algo.max_lag=1", "queue.timeout_s=60", "algo.queue_order=finish",
                      "task.reward_fn=tests.rollout.reward_fns:varies_on_one_prompt_in_eight", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = train_records(read_jsonl(run_dir / "metrics.jsonl"))
    assert [m["version"] for m in metrics] == [1, 2, 3]
    # More groups were dropped than the budget ((max_lag + 1) * prompts_per_step = 8) could ever hold.
    assert metrics[-1]["dropped/zero_variance_groups_total"] > 8


def test_mask_tokens_trains_groups_holding_stale_tokens_without_their_policy_gradient(
        embedded_count_model_dir, tmp_path):
    """algo.stale=mask_tokens at max_lag 1, groups sent as they finish, 4 groups a step: short groups overtake long
    ones, which reach the learner holding tokens 2 versions old (under drop_group such groups are dropped). Each such
    group is trained, not dropped; the loss gives exactly its tokens more than 1 version old no policy gradient
    (loss.max_token_lag, set to max_lag), and the console says how many. Whether a rollout outlasts two learner steps
    depends on the two processes' timing: on 2 busy cores a run can have none (CI saw it at 16 groups a step), so the
    run is repeated, up to three times, until one has stale tokens."""
    for attempt in range(3):
        run_dir = tmp_path / f"masked{attempt}"
        proc = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", "run.steps=12", "eval.sets=[]",
                          f"model.path={embedded_count_model_dir}", "algo.max_lag=1", "algo.queue_order=finish",
                          "algo.stale=mask_tokens", "algo.prompts_per_step=4", timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rollouts = read_jsonl(run_dir / "rollouts.jsonl")
        stale = sum(r["trained_at_step"] - v > 1 for r in rollouts for v in r["versions"])
        if stale:
            break
    assert OmegaConf.load(run_dir / "config.yaml").algo.loss.max_token_lag == 1
    metrics = train_records(read_jsonl(run_dir / "metrics.jsonl"))
    assert len(metrics) == 12 and metrics[-1]["dropped/stale_groups_total"] == 0
    assert len(rollouts) == 12 * 4 * 8  # every group trained
    for m in metrics:  # the loss's view: every token of lag 2 and above, and no other, got no gradient
        lags = [k for k in range(8) if m.get(f"lag{k}/token_share", 0) > 0]
        assert all(m[f"lag{k}/dropped_frac"] == (1.0 if k > 1 else 0.0) for k in lags), m
    masked = sum(m["mask/lag_frac"] * m["mask/tokens"] for m in metrics)
    assert stale > 0 and masked == pytest.approx(stale, abs=1e-6)
    assert f"{stale} tokens older than loss.max_token_lag given no policy gradient" in proc.stdout


def test_overlong_shaping_penalises_exactly_the_samples_near_their_limit(demo_run):
    """algo.advantage.overlong_buffer on the real demo: at every step, the penalty the learner took off the rewards
    it trained is DAPO's soft overlong punishment recomputed from rollouts.jsonl (each sample's length, its limit
    from its prompt and the run's config); reward_mean stays the task's reward, and the summary counts them."""
    from tests.algo.test_advantages import dapo_length_reward

    (proc, run_dir), buffer, penalty = demo_run, OVERLONG_BUFFER, OVERLONG_PENALTY
    cfg = OmegaConf.load(run_dir / "config.yaml")
    metrics, rollouts = train_records(read_jsonl(run_dir / "metrics.jsonl")), read_jsonl(run_dir / "rollouts.jsonl")
    assert len(metrics) == STEPS
    penalised = 0
    for m in metrics:
        trained = [r for r in rollouts if r["trained_at_step"] == m["step"]]
        limits = [min(cfg.sampling.max_new_tokens, cfg.sampler.max_seq_len - len(r["prompt_ids"])) for r in trained]
        assert min(limits) >= buffer  # the ramp DAPO prints: from limit - buffer to the limit
        expected = [penalty * dapo_length_reward(len(r["token_ids"]), limit, buffer) for r, limit in zip(trained, limits)]
        assert m["reward/overlong_penalty_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-9)
        assert m["samples/overlong_penalised"] == sum(p < 0 for p in expected)
        assert m["reward_mean"] == pytest.approx(sum(r["reward"] for r in trained) / len(trained))
        penalised += m["samples/overlong_penalised"]
    assert penalised > 0
    assert f"{penalised:.0f} of {len(rollouts)} trained samples came within algo.advantage.overlong_buffer" in proc.stdout


def test_raw_torchrun_command_from_the_readme_works(embedded_count_model_dir, tmp_path):
    """...and on-policy distillation rides along (no launch of its own): a raw launch checks the teacher on the
    learner rank (megarl.learner.build_learner) and scores every batch with it. The teacher is the student's own
    starting weights, so at step 0 (every token lag 0, sampled by those weights) the reverse KL is exactly 0.
    With max_lag=0 this run is also the default layout's (learner.tp=1) case of
    test_samplers_run_exactly_the_weights_the_learner_published: one launch for all three checks."""
    run_dir = tmp_path / "raw"
    proc = run_torchrun("megarl.roles.worker", 2, DEMO, f"run.dir={run_dir}", "run.steps=4", "algo.max_lag=0",
                        f"model.path={embedded_count_model_dir}", f"algo.distill.teacher={embedded_count_model_dir}",
                        module=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = train_records(read_jsonl(run_dir / "metrics.jsonl"))
    assert len(metrics) == 4
    assert metrics[0]["lag0/token_share"] == 1.0 and abs(metrics[0]["lag0/teacher_kl"]) < 1e-5
    assert abs(metrics[0]["distill/teacher_kl_k3"]) < 1e-5
    assert all(math.isfinite(m["distill/teacher_kl"]) and math.isfinite(m["loss"]) and m["distill/teacher_s"] > 0
               for m in metrics)
    check_samplers_ran_the_published_weights(metrics)


def test_sync_baseline_generates_one_batch_per_version_and_trains_k_epochs(embedded_count_model_dir, tmp_path):
    """...and the lr schedule runs over optimizer steps: 3 batches of 2 epochs are 6 (learner.lr_decay_steps=0)."""
    run_dir = tmp_path / "sync"
    proc = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", "run.steps=3", "algo.mode=sync",
                      "algo.sync_epochs=2", f"model.path={embedded_count_model_dir}", "learner.lr_warmup_steps=2",
                      "learner.lr_decay=linear", timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = train_records(read_jsonl(run_dir / "metrics.jsonl"))
    assert [m["version"] for m in metrics] == [2, 4, 6]  # K=2 optimizer steps per batch
    # A step's record is its last epoch's: optimizer steps 1, 3, 5 of 6 (warm-up 2, then linear to 0).
    assert [m["lr"] for m in metrics] == pytest.approx([5e-4, 3.75e-4, 1.25e-4])
    rollouts = read_jsonl(run_dir / "rollouts.jsonl")
    for r in rollouts:
        # every token of a sync batch comes from the one version the batch was generated under
        assert set(r["versions"]) == {r["trained_at_step"]}
    assert sorted({r["trained_at_step"] for r in rollouts}) == [0, 2, 4]
    # The demo's evaluations: the first and the last version (K epochs per step: version 6 after 3 steps).
    evals = eval_records(read_jsonl(run_dir / "metrics.jsonl"))
    assert [(e["eval_version"], e["step"]) for e in evals] == [(0, 0), (6, 3)]
    assert all(set(r["versions"]) == {r["eval_version"]} for r in read_jsonl(run_dir / "eval_samples.jsonl"))


def check_samplers_ran_the_published_weights(metrics: list[dict]) -> None:
    """A 4-step run at max_lag=0: every trained token was generated by the version the learner is at, i.e. by
    weights that travelled through the publish path (TP shards gathered, or shard to shard at sampler.tp=2;
    buckets, broadcast), and the sampler's log-probs of them are the learner's."""
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["lag0/token_share"] == 1.0
        assert m["lag0/logprob_gap_abs"] < 1e-4, (m["step"], m["lag0/logprob_gap_abs"])


# The default layout (learner.tp=1) is checked by test_raw_torchrun_command_from_the_readme_works's run.
# learner.dp=2's run also samples on the paged KV layout (small blocks, so requests span several).
@pytest.mark.parametrize("layout", ["learner.tp=2", "learner.dp=2 sampler.kv_layout=paged sampler.kv_block_size=8",
                                    "learner.pp=2", "learner.cp=2",
                                    "learner.tp=2 sampler.tp=2 eval.sets=[]",  # a TP engine cannot evaluate
                                    "learner.lora.rank=8"])
def test_samplers_run_exactly_the_weights_the_learner_published(embedded_count_model_dir, tmp_path, layout):
    run_dir = tmp_path / "parallel"
    proc = run_python("-m", "megarl.cli", "train", DEMO, f"run.dir={run_dir}", "run.steps=4", "algo.max_lag=0",
                      *layout.split(), f"model.path={embedded_count_model_dir}", timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = train_records(read_jsonl(run_dir / "metrics.jsonl"))
    check_samplers_ran_the_published_weights(metrics)
    if "sampler.tp=2" in layout:  # the lead's link carried exactly TP rank 0's slices, in fp32
        from megarl.models.convert import load_pretrained
        from megarl.models.tp_shard import shard

        _, weights = load_pretrained(str(embedded_count_model_dir))
        link = sum(shard(name, t, 2, 0).numel() * 4 for name, t in weights.items())
        whole = sum(t.numel() * 4 for t in weights.values())
        assert link < whole and {m["publish_bytes"] for m in metrics} == {link}
    if "paged" in layout:  # the engine ran on a block pool (only the paged layout has one: sampler{rank}/kv_blocks)
        assert all(any(k.endswith("/kv_blocks") and v > 0 for k, v in m.items()) for m in metrics)
    if "lora" in layout:  # only the adapter travelled, and the engine ran base + adapter (the lag-0 gap above)
        from megarl.config.schema import LoraConfig
        from megarl.models.lora import adapter_spec

        hf_config = json.loads((embedded_count_model_dir / "config.json").read_text())
        adapter = sum(math.prod(shape) * 4 for _, shape, _ in adapter_spec(hf_config, LoraConfig(rank=8)))
        assert {m["publish_bytes"] for m in metrics} == {adapter}


def test_a_tp2_engine_serves_the_moe_model_the_learner_publishes_whole(embedded_moe_model_dir, tmp_path):
    """configs/moe.yaml at sampler.tp=2 under a learner of TP 1 (megatron refuses TP for MoE): the learner
    publishes whole tensors, both engine ranks receive them and keep their slices (half of every expert's width,
    the router whole). At max_lag=0 the engine's log-probs are the learner's, and the routes its rank 0 recorded
    (sent with the samples, replayed by r3) are the ones the learner's own router chooses."""
    from megarl.models.convert import load_pretrained

    run_dir = tmp_path / "moe_tp2"
    proc = run_python("-m", "megarl.cli", "train", str(REPO / "configs" / "moe.yaml"), f"run.dir={run_dir}",
                      "run.steps=4", "algo.max_lag=0", "sampler.tp=2", "algo.prompts_per_step=8",
                      f"model.path={embedded_moe_model_dir}", timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = train_records(read_jsonl(run_dir / "metrics.jsonl"))
    check_samplers_ran_the_published_weights(metrics)
    for m in metrics:
        assert m["lag0/router_agreement"] == 1.0 and m["router/token_diff_frac"] == 0.0, m["step"]
    _, weights = load_pretrained(str(embedded_moe_model_dir))
    assert {m["publish_bytes"] for m in metrics} == {sum(t.numel() * 4 for t in weights.values())}
