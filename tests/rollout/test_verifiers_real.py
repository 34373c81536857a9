"""task.env=verifiers:<id> against the real `verifiers` 0.4.0 package, run from its own environment
(megarl/rollout/verifiers_env.py, built on first use): a single-turn environment from a local dataset with weighted
reward functions (tests/rollout/verifiers_envs/megarl_vf_products) lists its dataset as megarl's prompts, and trains
for two sync steps through the agent endpoint with its rewards as the samples' rewards, every model token versioned;
a multi-turn tool environment (megarl_vf_calc: an MCP tool server) runs its episodes through the endpoint, the model
scripted, every token accounted for, and trains the tool-calling model for two sync steps with its rubric's reward."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.verifiers
ENVS = Path(__file__).with_name("verifiers_envs")
ENV_ID = "megarl_vf_products"
ROWS = [json.loads(line) for line in (ENVS / ENV_ID / "products.jsonl").read_text().splitlines()]


@pytest.fixture
def env_on_path(monkeypatch):
    """The environment importable by the worker (it inherits megarl's PYTHONPATH), as a user's own module is."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(ENVS)]))


@pytest.mark.timeout(1800)  # the env's first build: 10 min on 2 loaded cores
def test_the_environment_dataset_is_the_prompts(env_on_path):
    from megarl.rollout.verifiers_adapter import META_TASK, VerifiersTask

    task = VerifiersTask(f"verifiers:{ENV_ID}")
    try:
        assert task.worker.harness == "null"
        assert [(p.text, p.answer, p.meta["operands"], p.meta[META_TASK]) for p in task.prompts] == [
            (row["question"], row["answer"], row["operands"], i) for i, row in enumerate(ROWS)]
        assert {p.meta["data_source"] for p in task.prompts} == {f"verifiers:{ENV_ID}"}
    finally:
        task.worker.close()
    assert task.worker.proc.returncode == 0


def train(run_dir: Path, config: str, model_dir: Path, env_id: str, *overrides: str) -> tuple[list[dict], list[dict]]:
    """Two sync steps of 2 prompts x 4 episodes of verifiers:<env_id>: the run's rollouts and metrics."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(ENVS)])}
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(REPO / "configs" / config),
                           f"run.dir={run_dir}", f"model.path={model_dir}", f"task.env=verifiers:{env_id}",
                           "eval.sets=[]", "run.steps=2", "algo.mode=sync", "algo.max_lag=0", "algo.group_size=4",
                           "algo.prompts_per_step=2", "learner.micro_batch_size=8", "task.agent_timeout_s=400",
                           *overrides], capture_output=True, text=True, timeout=1500, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return ([json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()],
            [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


def check_versions(r: dict) -> None:
    """Sync mode: every model token of the version its batch was generated for; environment tokens untrained."""
    for kind, start, end in r["spans"]:
        versions, logprobs = r["versions"][start:end], r["behaviour_logprobs"][start:end]
        if kind == "env":
            assert set(versions) == {-1} and set(logprobs) == {0.0}
        else:
            assert set(versions) == {r["trained_at_step"]} and all(lp <= 0 for lp in logprobs)


@pytest.mark.timeout(1800)
def test_a_verifiers_environment_trains_with_its_rewards(embedded_tool_model_dir, tmp_path):
    """Two sync steps of 2 prompts x 4 episodes, each episode the environment's chat harness talking to the
    sampler's endpoint: the sample's reward is the environment's weighted sum (calls_tool 0.5 + exact 1.0), with its
    parts in rollouts.jsonl, every model token of the version its batch was generated for, the lag-0 log-probs the
    learner's."""
    rollouts, metrics = train(tmp_path / "run", "multiturn_demo.yaml", embedded_tool_model_dir, ENV_ID)
    assert len(rollouts) == 2 * 2 * 4
    answers = {row["question"]: row for row in ROWS}
    for r in rollouts:
        assert r["reward_error"] is None and r["turns"] == 1
        row = answers[r["prompt"]]  # the prompt is a dataset row's
        reply = r["completion"].replace("<|im_end|>", "").strip()  # what the harness got as the message content
        a, b = row["operands"]
        assert r["reward"] == 0.5 * (reply.replace(" ", "") == f">>>{a}*{b}") + 1.0 * (reply == row["answer"])
        assert r["reward_parts"] == {  # the rubric's parts, as verifiers scored them, beside their weighted sum
            "calls_tool": {"score": float(reply.replace(" ", "") == f">>>{a}*{b}"), "weight": 0.5},
            "exact": {"score": float(reply == row["answer"]), "weight": 1.0}}
        assert r["source"] == f"verifiers:{ENV_ID}"
        check_versions(r)
    assert any(r["reward"] > 0 for r in rollouts)  # the tool model writes ">>> a*b" most of the time
    assert all(m["lag0/token_share"] == 1.0 and m["lag0/logprob_gap_abs"] < 1e-4 for m in metrics)


@pytest.mark.timeout(900)
def test_a_multi_turn_tool_environment_runs_through_the_endpoint_token_in_token_out(env_on_path):
    """megarl_vf_calc: verifiers' chat harness offers the environment's MCP tool `python` as OpenAI tools, the
    endpoint renders them with the chat template and parses the model's <tool_call> into tool_calls, the harness
    runs the call on the tool server and sends its answer back as a tool message (environment tokens: version -1),
    and the environment's `exact` reward scores the final reply. The engine is scripted (tests/rollout/test_agent.py),
    so every model token and version is known: the trained ids are exactly the scripted ones."""
    from megarl.embedded.tiny_chat import build_chat_tokenizer
    from megarl.rollout.verifiers_adapter import AGENT, VerifiersTask
    from tests.rollout.test_agent import ScriptedLoop

    tok = build_chat_tokenizer()
    task = VerifiersTask("verifiers:megarl_vf_calc", agent_timeout_s=400.0)
    right, wrong = task.prompts[0], task.prompts[1]

    def model(text: str) -> str:  # a call to the tool, then its answer copied (or, for `wrong`, miscopied)
        question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        if "<|im_start|>tool" not in text:
            return '<tool_call>\n{"name": "python", "arguments": {"code": "%s"}}\n</tool_call>' % question
        return text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>", 1)[0] if question == right.text else "1"

    loop = ScriptedLoop(tok, AGENT, model, timeout_s=400.0, max_seq_len=1024, max_new_tokens=64)
    try:
        episodes = sorted(loop.run([right, wrong], deadline_s=800.0), key=lambda e: e.key)
    finally:
        task.worker.close()
    assert [(e.error, e.reward, e.turns) for e in episodes] == [(None, 1.0, 2), (None, 0.0, 2)]
    # The rubric's parts beside the sum (rewards.Scored): its one reward function, by name, with its weight.
    assert [e.reward_parts for e in episodes] == [{"exact": {"score": 1.0, "weight": 1.0}},
                                                  {"exact": {"score": 0.0, "weight": 1.0}}]
    for episode, prompt in zip(episodes, (right, wrong)):
        [(start, end)] = episode.env_spans
        env_text = tok.decode(episode.token_ids[start:end])
        assert "<|im_start|>tool\n" in env_text and ROWS[prompt.meta["verifiers_task"]]["answer"] in env_text
        call_versions, answer_versions = set(episode.versions[:start]), set(episode.versions[end:])
        assert set(episode.versions[start:end]) == {-1}  # the scripted engine versions each turn by its order
        assert len(call_versions) == len(answer_versions) == 1 and min(call_versions) < min(answer_versions)
        call = tok.decode(episode.token_ids[:start])
        assert call.startswith("<tool_call>") and prompt.text in call  # the sampled ids, not a re-rendering


@pytest.mark.timeout(1800)
def test_a_multi_turn_tool_environment_trains_with_its_rubric(embedded_toolcall_model_dir, tmp_path):
    """megarl_vf_calc trained as it is: verifiers' harness offers the MCP server's `python` tool, the tool-calling
    model (tiny-qwen2-toolcall) calls it through the endpoint, the harness runs the call on the tool server and sends
    the result back, the model answers. Two sync steps of 2 prompts x 4 episodes: each sample's reward is the
    rubric's `exact` with its part recorded, the tool's answer is environment tokens (untrained), every model token
    of its batch's version, the lag-0 log-probs the learner's."""
    rollouts, metrics = train(tmp_path / "run", "multiturn_tools.yaml", embedded_toolcall_model_dir,
                              "megarl_vf_calc", "task.agent=", "task.name=")
    assert len(rollouts) == 2 * 2 * 4
    answers = {row["question"]: row["answer"] for row in ROWS}
    called = []
    for r in rollouts:
        assert r["reward_error"] is None and r["source"] == "verifiers:megarl_vf_calc"
        reply = r["completion"].rsplit("<|im_start|>assistant\n", 1)[-1].replace("<|im_end|>", "").strip()
        assert r["reward"] == float(reply == answers[r["prompt"]])
        assert r["reward_parts"] == {"exact": {"score": r["reward"], "weight": 1.0}}
        check_versions(r)
        env_spans = [(start, end) for kind, start, end in r["spans"] if kind == "env"]
        assert len(env_spans) == r["turns"] - 1
        if env_spans:  # the model called the tool: its call, the tool's result (the product) as environment tokens
            called.append(r)
            assert r["completion"].startswith("<tool_call>") and "<|im_start|>tool\n" in r["completion"]
    # Warm-started to call the tool (97% of sampled episodes) and to copy its answer (~half): of 16 episodes,
    # none calling or none right has probability < 1e-4.
    assert called and any(r["reward"] == 1.0 for r in called)
    assert all(m["lag0/token_share"] == 1.0 and m["lag0/logprob_gap_abs"] < 1e-4 for m in metrics)
