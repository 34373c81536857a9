"""End to end, multi-turn: `megarl train configs/multiturn_demo.yaml` runs tool-using episodes through the
whole data path (built-in engine, the Python tool in the sandbox, queue, megatron learner, in-flight
publishes) and rollouts.jsonl shows every episode's turns, versions and untrained environment spans, and
its held-out evaluations are whole episodes of one version each; an agent written against the `openai`
client does the same through the sampler's endpoint."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.observe.sinks import eval_records, train_records
from tests.helpers import REPO

DEMO = str(REPO / "configs" / "multiturn_demo.yaml")
TOOLS_DEMO = str(REPO / "configs" / "multiturn_tools.yaml")
EVAL_EVERY, EVAL_PROMPTS = 3, 8


def train(run_dir: Path, model_dir: Path, *overrides: str, config: str = DEMO) -> tuple[list[dict], str]:
    """The run's rollouts and its console output."""
    # docs/examples/agent on the path: the shipped agent is importable as tool_agent, as docs/multiturn.md runs it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "docs" / "examples" / "agent")])}
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", config, f"run.dir={run_dir}",
                           f"model.path={model_dir}", *overrides], capture_output=True, text=True, timeout=400,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()], proc.stdout


def check_episode(r: dict) -> None:
    n = len(r["token_ids"])
    assert len(r["versions"]) == len(r["behaviour_logprobs"]) == n
    kinds = [kind for kind, _, _ in r["spans"]]
    assert kinds[0] == "model" and all(a != b for a, b in zip(kinds, kinds[1:]))  # alternating runs
    assert r["spans"][-1][2] == n and all(s[2] == t[1] for s, t in zip(r["spans"], r["spans"][1:]))
    assert kinds.count("model") == r["turns"]
    for kind, start, end in r["spans"]:
        versions, logprobs = r["versions"][start:end], r["behaviour_logprobs"][start:end]
        if kind == "env":  # never trained: no behaviour log-prob, no version
            assert set(versions) == {-1} and set(logprobs) == {0.0}
        else:
            assert min(versions) >= 0 and versions == sorted(versions) and all(lp <= 0 for lp in logprobs)


def test_pipeline_episodes_span_versions_across_turns_with_environment_tokens_masked(embedded_tool_model_dir,
                                                                                     tmp_path):
    # The demo's held-out evaluation, smaller and more often: versions 0, 3 and 6 (check_evaluations).
    rollouts, out = train(tmp_path / "run", embedded_tool_model_dir, "run.steps=6", f"eval.every_steps={EVAL_EVERY}",
                          f"eval.sets=[{{name: heldout, prompts: {EVAL_PROMPTS}}}]")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    metrics = train_records(records)
    assert len(rollouts) == 6 * 64
    for r in rollouts:
        check_episode(r)
    two_turns = [r for r in rollouts if r["turns"] >= 2]
    assert len(two_turns) > len(rollouts) / 2  # the warm-started model calls the tool, then answers
    text = two_turns[0]["completion"]
    assert text.startswith(">>> ") and "<|im_start|>tool\n" in text
    spanning = [r for r in two_turns if len({v for v in r["versions"] if v >= 0}) >= 2]
    assert spanning, "no episode of >= 2 model turns holds tokens of >= 2 policy versions"
    assert any(r["reward"] == 1.0 for r in rollouts)
    # The learner scores the same tokens the engine sampled, environment tokens included in the context.
    assert metrics[0]["lag0/token_share"] == 1.0 and metrics[0]["lag0/logprob_gap_abs"] < 1e-4
    assert all(m["sampler1/env_failures"] == 0 for m in metrics) and metrics[-1]["turns_mean"] >= 1.5
    check_evaluations(tmp_path / "run", embedded_tool_model_dir, eval_records(records), rollouts, out)


def check_evaluations(run_dir: Path, model_dir: Path, evals: list[dict], rollouts: list[dict], out: str) -> None:
    """Multi-turn evaluation: one eval record per due version, its console line and summary; every model token of
    every eval episode of the version its score is labelled with (publishes landed meanwhile: they stayed staged),
    the tool's tokens -1; no eval prompt trained on; version 0 equals `megarl eval` on the base model."""
    from megarl.config.load import load_config
    from megarl.eval.standalone import evaluate_model

    assert [(e["eval_version"], e["step"]) for e in evals] == [(0, 0), (3, 3), (6, 6)]
    assert "megarl: eval version 3 (step 3" in out and "megarl: eval heldout: pass@1" in out
    for e in evals:
        assert 0 <= e["eval/heldout/pass@1"] <= e["eval/heldout/pass@4"] <= 1
        assert e["eval/heldout/prompts"] == EVAL_PROMPTS and e["eval/heldout/turns_mean"] >= 1.5
    samples = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * EVAL_PROMPTS * (4 + 1)
    for r in samples:  # per token, from the records
        model_versions = {v for v in r["versions"] if v != -1}
        assert model_versions == {r["eval_version"]}, (r["eval_version"], r["versions"])
        assert (-1 in r["versions"]) == (r["turns"] >= 2)  # the tool's turn between model turns, never a version
    assert sum(r["turns"] >= 2 for r in samples) > len(samples) / 2 and any(r["reward"] == 1.0 for r in samples)
    assert not {r["prompt"] for r in samples} & {r["prompt"] for r in rollouts}  # the held-out split
    cfg = load_config(DEMO, [f"model.path={model_dir}", f"eval.sets=[{{name: heldout, prompts: {EVAL_PROMPTS}}}]"])
    standalone = evaluate_model(cfg, model_dir)
    assert standalone["records"] == [{k: v for k, v in r.items() if k not in ("eval_version", "share")}
                                     for r in samples if r["eval_version"] == 0]
    assert {k: v for k, v in standalone["metrics"].items() if k != "eval_s"} == \
        {k: v for k, v in evals[0].items() if k.startswith("eval/") and k != "eval/publishes_during"}


def check_agent_run(rollouts: list[dict], run_dir: Path) -> None:
    """A 2-step sync run of an agent: 64 episodes a step, each checked (check_episode), with no reward error, every
    model token of the version its batch was generated for; most episodes called the tool and some were right; the
    sampler's log-probs are the learner's; a turn refused for the context (the sampled tool code may print a long
    error) ends its episode truncated, not failed."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 64
    for r in rollouts:
        check_episode(r)
        assert r["reward_error"] is None
        assert {v for v in r["versions"] if v >= 0} == {r["trained_at_step"]}
    assert sum(r["turns"] >= 2 for r in rollouts) > len(rollouts) / 2 and any(r["reward"] == 1.0 for r in rollouts)
    assert all(m["lag0/token_share"] == 1.0 and m["lag0/logprob_gap_abs"] < 1e-4 for m in metrics)
    truncated = sum(r["finish_reason"] == "length" for r in rollouts)
    assert metrics[-1]["sampler1/over_context"] <= truncated  # a count since the start


@pytest.fixture(scope="module")
def agent_run(embedded_tool_model_dir, tmp_path_factory) -> tuple[list[dict], Path]:
    """(rollouts, run.dir) of a 2-step sync run whose episodes the shipped agent drives for half the prompts and the
    streaming agent for the others (tests.roles.streamed_tool_agent.shipped_or_streamed): one launch for both agents'
    tests."""
    run_dir = tmp_path_factory.mktemp("agents") / "run"
    rollouts, _ = train(run_dir, embedded_tool_model_dir, "run.steps=2", "algo.mode=sync", "algo.max_lag=0",
                        "task.agent=tests.roles.streamed_tool_agent:shipped_or_streamed",
                        "eval.sets=[]")  # agents are not evaluated yet (docs/eval.md)
    return rollouts, run_dir


def test_an_openai_client_agent_trains_through_the_sampler_endpoint_in_sync_mode(agent_run):
    """The shipped agent (docs/examples/agent/tool_agent.py) drives the episodes of its prompts (check_agent_run checks
    every episode); sync mode, so each episode runs under the one version its batch was generated for."""
    from tests.roles.streamed_tool_agent import streamed

    rollouts, run_dir = agent_run
    check_agent_run(rollouts, run_dir)
    assert any(not streamed(r["prompt"]) for r in rollouts)


def test_a_streaming_agent_trains_through_the_sampler_endpoint(agent_run):
    """The shipped agent reading its replies as streams (tests/roles/streamed_tool_agent.py) drives the episodes of
    the other prompts: the sampler streams each turn from its engine token by token and trains exactly the sampled
    tokens (check_agent_run), as for the plain agent, and no stream was cut."""
    from tests.roles.streamed_tool_agent import streamed

    rollouts, run_dir = agent_run
    check_agent_run(rollouts, run_dir)
    assert any(streamed(r["prompt"]) for r in rollouts)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["sampler1/stream_disconnects"] == 0


@pytest.mark.heavy  # tiny-qwen2-toolcall's first build: ~5 min of CPU (pytest.ini)
@pytest.mark.timeout(3600)  # the build runs in the fixture's setup, which counts: 5 min idle, several times that loaded
def test_a_tools_agent_trains_through_openai_tool_calling(embedded_toolcall_model_dir, tmp_path):
    """configs/multiturn_tools.yaml: the `tools=` agent (docs/examples/agent/tools_agent.py) gets its calls as
    message.tool_calls; every trained token is a sampled one with its version, the tool messages are environment
    tokens (sync mode: every model token of an episode is of the version its batch was generated for)."""
    rollouts, _ = train(tmp_path / "run", embedded_toolcall_model_dir, "run.steps=2", "algo.mode=sync",
                        "algo.max_lag=0", config=TOOLS_DEMO)
    check_agent_run(rollouts, tmp_path / "run")


def test_agent_episodes_failing_before_any_request_are_counted_and_a_sync_run_goes_on(embedded_tool_model_dir,
                                                                                       tmp_path):
    """Episodes whose agent raised before its first request have no tokens: the sampler drops them (the learner's
    wire check would refuse their group) and counts them; the group that lost all of them is replaced, so the sync
    run, which waits for every group of a step, finishes."""
    from tests.roles.first_calls_fail_agent import FAILING
    group_size, groups, steps = 4, 2, 2
    rollouts, out = train(tmp_path / "run", embedded_tool_model_dir, f"run.steps={steps}", "algo.mode=sync",
                          "algo.max_lag=0", f"algo.group_size={group_size}", f"algo.prompts_per_step={groups}",
                          "learner.micro_batch_size=8", "task.env_workers=4",
                          "task.agent=tests.roles.first_calls_fail_agent:run", "eval.sets=[]", "queue.timeout_s=120")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == steps
    # The first group failed whole and was replaced by a full one; the next lost FAILING - group_size episodes.
    assert len(rollouts) == steps * groups * group_size - (FAILING - group_size)
    assert metrics[-1]["sampler1/env_failures"] == FAILING and metrics[-1]["sampler1/dropped_samples"] == FAILING
    assert metrics[-1]["sampler1/failed_groups"] == 1
    assert f"{FAILING} episodes failed" in out and "1 groups left empty and replaced" in out
    for r in rollouts:
        check_episode(r)
