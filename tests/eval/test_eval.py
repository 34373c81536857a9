"""Evaluation on a real built-in engine and a real store: each score is of exactly one version while
publishes land during the evaluation; missed versions are reported as missed; bad input is refused
before launch (FILE:LINE, the key) or counted, never a crash; `megarl eval` writes its JSON result."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megarl.config.load import ConfigError, load_config
from megarl.eval.learner_side import EvalCollector
from megarl.eval.run import eval_seed, run_share
from megarl.eval.sampler_side import EVAL_STEP_EVERY, MAX_PINNED, VersionEvaluator, result_key
from megarl.eval.sets import build_sets, check_sets, due_versions, prompt_count
from megarl.models.convert import load_pretrained
from megarl.observe.jsonl import read_jsonl
from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine
from tests.helpers import REPO, save_tiny_qwen2

DEMO = str(REPO / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Qwen2 with the embedded tokenizer (264 tokens): fast, and its samples vary."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("eval_model"), False, vocab_size=264, tokenizer=True)


def config(model_dir, run_dir, *overrides):
    return load_config(DEMO, [f"model.path={model_dir}", f"run.dir={run_dir}", "run.steps=4", "eval.every_steps=1",
                              "eval.sets=[{name: heldout, prompts: 6}]", "eval.samples=3", "eval.k=2",
                              "sampler.max_seq_len=24", "sampling.max_new_tokens=8", "sampler.max_running=8",
                              *overrides])


def scaled(weights: dict, factor: float) -> dict:
    return {name: t * factor for name, t in weights.items()}


def training_step(engine) -> list:
    """The sampler loop's own step after `before_step` applied what was staged."""
    return engine.step(apply_staged=False)


def test_the_training_engine_applies_a_new_version_while_the_previous_one_is_evaluated(model_dir, tmp_path):
    """The learner never waits for an evaluation, by construction: version 1 is applied to the training engine,
    and training decodes under it, while the evaluation of version 0 is in progress on its pinned engine; the
    evaluation still scores version 0 only, sample for sample what it gives run alone (`megarl eval`'s way)."""
    from transformers import AutoTokenizer

    cfg = config(model_dir, tmp_path, "eval.every_steps=2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, weights = load_pretrained(str(model_dir))
    engine = BuiltinEngine.from_pretrained(str(model_dir), max_running=8, max_seq_len=24, seed=1)
    for i in range(4):  # training requests in flight when the evaluation starts
        engine.add_request(GenerationRequest(f"train/{i}", [100, 45, 107, 61], SamplingParams(1.0, 1.0, 0, 16), ()))
    store = dist.HashStore()
    evaluator = VersionEvaluator(cfg, store, tokenizer, share=0, shares=1, first_version=0)
    evaluator.before_step(engine, lambda: pytest.fail("an evaluation was run to completion"))  # pins version 0
    training_step(engine)
    assert evaluator.evaluating and evaluator.pending == [0, 2, 4]
    pinned = evaluator.running[0][0].engine
    before = pinned.stats()["decode_steps"]
    for _ in range(EVAL_STEP_EVERY):  # the training engine decodes: one evaluation step in EVAL_STEP_EVERY turns
        evaluator.before_step(engine, lambda: pytest.fail("an evaluation was run to completion"))
        training_step(engine)
    assert pinned.stats()["decode_steps"] == before + 1 and engine.num_unfinished
    engine.stage_weights(scaled(weights, 1.25), 1)  # the learner's publish: staged by the receiver, nothing waits
    evaluator.before_step(engine, lambda: pytest.fail("an evaluation was run to completion"))
    assert engine.version == 1 and evaluator.evaluating and 0 in evaluator.pending
    training_step(engine)
    assert 1 in {v for p in engine.progress().values() for v in p.versions}  # decoded under 1, during version 0's eval
    steps = 0
    while evaluator.evaluating:
        evaluator.before_step(engine, lambda: pytest.fail("an evaluation was run to completion"))
        training_step(engine)
        steps += 1
    evaluator.close()
    assert steps > 1 and evaluator.pending == [2, 4]
    result = json.loads(store.get(result_key(0, 0)))
    assert result["publishes_during"] == 1  # version 1 was applied while version 0 was evaluated
    samples = read_jsonl(tmp_path / "eval_samples.jsonl")
    assert len(samples) == 6 * (3 + 1) and all(set(r["versions"]) == {0} for r in samples)
    alone = run_share(BuiltinEngine.from_pretrained(str(model_dir), max_running=1, max_seq_len=24).pinned(
        max_running=8, seed=eval_seed(0, 0)), tokenizer, evaluator.sets, cfg, 0, 1)
    assert alone["records"] == [{k: v for k, v in r.items() if k not in ("eval_version", "share")} for r in samples]


def test_every_eval_token_is_of_the_labelled_version_while_publishes_land(model_dir, tmp_path):
    from transformers import AutoTokenizer

    cfg = config(model_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, weights = load_pretrained(str(model_dir))
    engine = BuiltinEngine.from_pretrained(str(model_dir), max_running=8, max_seq_len=24, seed=1)
    training = SamplingParams(1.0, 1.0, 0, 16)
    for i in range(4):  # training requests in flight when the evaluation starts
        engine.add_request(GenerationRequest(f"train/{i}", [100, 45, 107, 61], training, ()))
    engine.step()
    store = dist.HashStore()
    evaluator = VersionEvaluator(cfg, store, tokenizer, share=0, shares=1, first_version=0)
    assert evaluator.pending == [0, 1, 2, 3, 4]
    evaluator.before_step(engine, lambda: None)  # version 0 pinned
    for version in (1, 2, 3):  # three publishes during one step: the staging buffer keeps two, 1 is dropped
        engine.stage_weights(scaled(weights, 1 + version / 4), version)
    evaluator.before_step(engine, lambda: None)  # 2 applied and pinned beside 0; 1 reported missed, never scored
    assert engine.version == 2 and engine.staged_versions() == [3]
    assert json.loads(store.get(result_key(1, 0)))["missed"].startswith("sampler engine 0 never ran version 1")
    assert all(set(c.versions) <= {0, 2} for c in training_step(engine))  # training goes on, under 2
    assert [run.version for run, _ in evaluator.running] == [0, 2] and len(evaluator.running) == MAX_PINNED
    evaluator.before_step(engine, lambda: None)  # 3 is due: the oldest evaluation (0) is finished before 3 is pinned
    assert engine.version == 3 and [run.version for run, _ in evaluator.running] == [2, 3]
    assert store.check([result_key(0, 0)]) and evaluator.pending == [2, 3, 4]
    while evaluator.evaluating:
        evaluator.before_step(engine, lambda: None)
        training_step(engine)
    assert evaluator.pending == [4]
    evaluator.close()

    samples = read_jsonl(tmp_path / "eval_samples.jsonl")
    assert sorted({r["eval_version"] for r in samples}) == [0, 2, 3]
    for r in samples:  # per token, from the records
        assert r["versions"] and set(r["versions"]) == {r["eval_version"]}
    assert len(samples) == 3 * 6 * (3 + 1)
    assert json.loads(store.get(result_key(0, 0)))["publishes_during"] == 2  # 2 and 3 applied meanwhile

    reported, notes = [], []
    collector = EvalCollector(cfg, store, 1, 0, 0, lambda v, s, m: reported.append((v, s, m)), notes.append)
    for version in (1, 2, 3):
        collector.published(version, version)
    collector.poll(3)
    assert [v for v, _, _ in reported] == [0, 2, 3] and collector.pending == [4]
    assert notes and "eval of version 1 not reported" in notes[0]
    assert reported[0][2]["eval/publishes_during"] == 2.0 and reported[0][2]["eval/heldout/prompts"] == 6
    collector.cfg.eval.timeout_s = 0.3
    collector.finish(4)  # version 4 never comes: said, not waited for forever
    assert "eval of version(s) [4]: no result from every sampler within eval.timeout_s=0.3s" in notes[-1]


def test_a_run_starts_its_evaluations_at_its_resumed_version(model_dir, tmp_path):
    cfg = config(model_dir, tmp_path, "eval.every_steps=2", "run.steps=7")
    assert due_versions(cfg) == {0, 2, 4, 6, 7}
    assert due_versions(cfg, first_version=3) == {3, 4, 6, 7}
    sync = config(model_dir, tmp_path, "eval.every_steps=2", "run.steps=3", "algo.mode=sync", "algo.sync_epochs=2")
    assert due_versions(sync) == {0, 4, 6}  # a step publishes 2 versions later
    assert due_versions(config(model_dir, tmp_path, "eval.at_start=false", "eval.at_end=false",
                               "eval.every_steps=0")) == set()
    # HTTP engines evaluate: the thread that updates their server holds the due version (test_eval_sglang.py).
    assert due_versions(config(model_dir, tmp_path, "sampler.engine=sglang")) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("override, message", [
    ("eval.k=4", "eval.k: pass@k needs 1 <= k <= eval.samples=3"),
    ("eval.samples=0", "eval.samples: must be >= 1"),
    ("eval.sets=[{name: a/b}]", "eval.sets[0].name: must be a non-empty name without '/'"),
    ("eval.sets=[{name: a},{name: a}]", "eval.sets[1].name: 'a' names two sets"),
    ("eval.sets=[{path: /nonexistent.jsonl}]", "eval.sets[0].path: file not found: /nonexistent.jsonl"),
    ("eval.sets=[{reward_fn: 'not a path:x'}]", "eval.sets[0].reward_fn: 'not a path:x' is not of the form"),
    ("eval.max_new_tokens=24", "eval.max_new_tokens: (24) must be smaller than sampler.max_seq_len (24)"),
    ("eval.heldout_fraction=1", "eval.heldout_fraction: must be in (0, 1), got 1"),
    # What no engine can pin yet is refused before launch, not trained without evaluating.
    (("learner.tp=2", "sampler.tp=2"), "eval.sets: the built-in engine at sampler.tp=2 cannot evaluate a version exactly"),
    (("task.name=tool_arith", "sampler.engine=sglang"),
     "eval.sets: multi-turn episodes (task.name=tool_arith) are evaluated on sampler.engine=builtin only"),
    ("task.agent=tool_agent:run", "eval.sets: agent tasks (task.agent=tool_agent:run) are not evaluated yet"),
])
def test_bad_eval_config_is_refused_naming_the_key(model_dir, tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        config(model_dir, tmp_path, *((override,) if isinstance(override, str) else override))
    assert message in str(err.value)


def test_a_malformed_eval_file_is_refused_at_its_line(model_dir, tmp_path):
    path = tmp_path / "held.jsonl"
    path.write_text('{"prompt": "a-c=", "answer": "abc"}\n\n{"prompt": "b-d=", \n')
    cfg = config(model_dir, tmp_path, f"eval.sets=[{{name: file, path: {path}}}]")
    with pytest.raises(ValueError, match=f"{path}:3: not valid JSON"):
        build_sets(cfg)


def test_failing_rewards_and_overlong_prompts_are_counted_not_raised(model_dir, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in ["a-c=", "z" * 40, "b-e="]))
    cfg = config(model_dir, tmp_path, f"eval.sets=[{{name: file, path: {path}, prompts: 0, "
                                      f"reward_fn: 'tests.rollout.reward_fns:raises'}}]")
    plain = config(model_dir, tmp_path, f"eval.sets=[{{name: file, path: {path}, prompts: 0}}]")
    assert "eval set file: 3 prompts" in check_sets(plain, model_dir)[0]
    assert "1 longer than sampler.max_seq_len=24 (skipped, counted)" in check_sets(plain, model_dir)[0]
    with pytest.raises(ValueError, match="tests.rollout.reward_fns:raises"):  # at launch: fails on its own answers
        check_sets(cfg, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = BuiltinEngine.from_pretrained(str(model_dir), max_running=8, max_seq_len=24).pinned(max_running=8, seed=0)
    result = run_share(engine, tokenizer, build_sets(cfg), cfg, 0, 1)
    assert result["skipped_overlong"] == {"file": 1}
    assert len(result["records"]) == 2 * 4 and all(r["reward"] == 0.0 for r in result["records"])
    assert all(r["reward_error"].startswith("ValueError") for r in result["records"])


def test_megarl_eval_writes_the_json_result(model_dir, tmp_path):
    from megarl.cli import main

    out = tmp_path / "result.json"
    with pytest.raises(SystemExit) as done:
        main(["eval", DEMO, f"model.path={model_dir}", "eval.sets=[{name: heldout, prompts: 4}]",
              "sampler.max_seq_len=24", "sampling.max_new_tokens=6", "--out", str(out)])
    assert done.value.code == 0
    result = json.loads(out.read_text())
    assert result["version"] == 0 and result["metrics"]["eval/heldout/prompts"] == 4
    assert len(result["records"]) == 4 * (4 + 1) and {v for r in result["records"] for v in r["versions"]} == {0}
    with pytest.raises(SystemExit) as refused:
        main(["eval", DEMO, f"model.path={model_dir}", "eval.sets=[]"])
    assert refused.value.code == 2


def test_a_set_whose_prompts_name_their_source_is_scored_per_source_too(model_dir, tmp_path):
    """eval/<set>/source/<name>/<metric>: score_set over that source's records; each record says its source."""
    from megarl.cli import main
    from megarl.eval.score import score_set

    path, out = tmp_path / "held.jsonl", tmp_path / "result.json"
    rows = [{"prompt": p, "answer": a, "data_source": s} for p, a, s in
            [("a-c=", "abc", "short"), ("b-d=", "bcd", "short"), ("c-m=", "cdefghijklm", "long run")]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as done:
        main(["eval", DEMO, f"model.path={model_dir}", f"eval.sets=[{{name: file, path: {path}, prompts: 0}}]",
              "sampler.max_seq_len=24", "sampling.max_new_tokens=6", "--out", str(out)])
    assert done.value.code == 0
    result = json.loads(out.read_text())
    assert {r["source"] for r in result["records"]} == {"short", "long run"}
    for source, tag in (("short", "short"), ("long run", "long_run")):
        expected = score_set([r for r in result["records"] if r["source"] == source], 4)
        assert {k.rsplit("/", 1)[1]: v for k, v in result["metrics"].items()
                if k.startswith(f"eval/file/source/{tag}/")} == expected
    assert result["metrics"]["eval/file/source/short/prompts"] == 2


@pytest.mark.parametrize("task", ["count", "arithmetic", "python_output", "tool_arith"])
def test_built_in_sets_draw_only_held_out_prompts_and_training_never_does(model_dir, tmp_path, task):
    import random

    from megarl.rollout.environment import is_multi_turn
    from megarl.rollout.heldout import is_heldout, training_split
    from megarl.rollout.tasks import task_from_config

    cfg = config(model_dir, tmp_path, f"task.name={task}", "eval.sets=[{name: heldout, prompts: 64}]")
    heldout = {p.text for p in build_sets(cfg)[0].prompts}
    assert all(is_heldout(text, 0.1) for text in heldout) and len(heldout) > 10
    training = training_split(task_from_config(cfg.task), cfg.eval.heldout_fraction)
    drawn = {p.text for p in training.sample_prompts(random.Random(0), 3000)}
    assert not drawn & heldout and not any(is_heldout(text, 0.1) for text in drawn)
    # The training side of a multi-turn task still runs episodes (the sampler checks is_multi_turn).
    assert is_multi_turn(training) == (task == "tool_arith")
    # The split follows the text only: the task's own draws fall on both sides, about 1 in 10 held out.
    own = task_from_config(cfg.task).sample_prompts(random.Random(0), 3000)
    assert 0.05 < sum(is_heldout(p.text, 0.1) for p in own) / 3000 < 0.15


def test_a_dataset_with_no_prompt_on_one_side_of_the_split_is_refused_before_launch(model_dir, tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "a-c=", "answer": "abc"}) + "\n")
    cfg = config(model_dir, tmp_path, "task.name=jsonl", f"task.path={path}")
    with pytest.raises(ValueError, match="none of them a (held-out|training) prompt: the task has too few distinct"):
        check_sets(cfg, model_dir)


def test_multi_turn_eval_episodes_are_of_one_version_while_publishes_land_and_reproducible(embedded_tool_model_dir,
                                                                                           tmp_path):
    """tool_arith: an eval sample is a whole episode (model turns, the tool's turn between them); every model token
    is of the evaluated version while a version is published and applied during the evaluation, the environment's tokens
    carry -1, the reward is the episode's, and `megarl eval` (evaluate_model) reproduces it sample for sample."""
    from transformers import AutoTokenizer

    from megarl.eval.standalone import evaluate_model

    model = str(embedded_tool_model_dir)
    cfg = load_config(str(REPO / "configs" / "multiturn_demo.yaml"), [
        f"model.path={model}", f"run.dir={tmp_path}", "run.steps=2", "eval.sets=[{name: heldout, prompts: 4}]",
        "eval.samples=2", "eval.k=2", "eval.every_steps=2", "eval.max_running=8"])
    torch.set_num_threads(cfg.sampler.threads)  # as the sampler and evaluate_model run it
    tokenizer = AutoTokenizer.from_pretrained(model)
    _, weights = load_pretrained(model)
    engine = BuiltinEngine.from_pretrained(model, max_running=8, max_seq_len=cfg.sampler.max_seq_len, seed=1)
    store = dist.HashStore()
    evaluator = VersionEvaluator(cfg, store, tokenizer, share=0, shares=1, first_version=0)
    evaluator.before_step(engine, lambda: None)  # version 0 pinned
    engine.stage_weights(scaled(weights, 0.5), 1)  # version 1 arrives while version 0 is evaluated
    evaluator.before_step(engine, lambda: None)
    assert engine.version == 1 and evaluator.evaluating  # applied to the training engine; the evaluation goes on
    while evaluator.evaluating:
        evaluator.before_step(engine, lambda: None)
    evaluator.close()
    result = json.loads(store.get(result_key(0, 0)))
    assert result["publishes_during"] == 1 and len(result["records"]) == 4 * (2 + 1)

    samples = read_jsonl(tmp_path / "eval_samples.jsonl")
    assert len(samples) == 4 * (2 + 1) and {r["eval_version"] for r in samples} == {0}
    for r in samples:  # per token, from the records: the model's of version 0, the tool's -1
        assert set(r["versions"]) <= {0, -1} and 0 in r["versions"]
        assert r["tokens"] == r["versions"].count(0) and r["finish_reason"] in ("stop", "length")
    two_turns = [r for r in samples if r["turns"] >= 2]
    assert two_turns and all("<|im_start|>tool\n" in r["completion"] and -1 in r["versions"] for r in two_turns)
    assert any(r["reward"] == 1.0 for r in samples)  # the warm-started model calls the tool and copies its answer
    # The same episodes, the same scores, whatever the tool's timing: again with every tool output memoised (the
    # same sets: answers at once, while other turns still decode), and by `megarl eval` (fresh sets and tool).
    in_run = [{k: v for k, v in r.items() if k not in ("eval_version", "share")} for r in samples]
    base = BuiltinEngine.from_pretrained(model, max_running=1, max_seq_len=cfg.sampler.max_seq_len)
    again = run_share(base.pinned(max_running=8, seed=eval_seed(0, 0)), tokenizer, evaluator.sets, cfg, 0, 1)
    assert again["records"] == in_run
    standalone = evaluate_model(cfg, model)
    assert standalone["records"] == in_run
    assert standalone["metrics"]["eval/heldout/turns_mean"] >= 1.5


def test_a_set_with_repeated_prompts_says_how_many_are_distinct():
    from megarl.protocols import Prompt

    drawn = [Prompt(f"{i % 29}+1=", str(i % 29 + 1)) for i in range(64)]  # 64 draws with replacement, 29 prompts
    assert prompt_count(drawn) == "64 prompts (29 distinct)"
    assert prompt_count(drawn[:29]) == "29 prompts"


def test_overlong_counts_are_remembered_by_tokenizer_files_prompts_and_limit(model_dir, tmp_path, monkeypatch):
    """`megarl train` counts each eval set's prompts too long for sampler.max_seq_len with the samplers' tokenizer
    (transformers: ~2 CPU-s on the cores the ranks start on); the counts are remembered in model.cache_dir under
    the tokenizer's files, the prompts and the limit, so a second check loads no tokenizer, and another limit
    counts again."""
    import transformers

    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in ["a-c=", "z" * 40, "y" * 30]))
    sets = f"eval.sets=[{{name: file, path: {path}, prompts: 0}}]"
    cfg = config(model_dir, tmp_path, sets, f"model.cache_dir={tmp_path / 'cache'}")
    assert "2 longer than sampler.max_seq_len=24" in check_sets(cfg, model_dir)[0]

    def no_load(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_load)
    assert "2 longer than sampler.max_seq_len=24" in check_sets(cfg, model_dir)[0]
    longer = config(model_dir, tmp_path, sets, f"model.cache_dir={tmp_path / 'cache'}", "sampler.max_seq_len=36")
    assert "the tokenizer was loaded again" in check_sets(longer, model_dir)[0]  # (a load error is said, not raised)
    monkeypatch.undo()
    assert "1 longer than sampler.max_seq_len=36" in check_sets(longer, model_dir)[0]


def test_a_replacement_evaluator_holds_no_update_before_it_joins_and_posts_earlier_shares_as_missed(model_dir,
                                                                                                   tmp_path):
    # fault.on_failure=replace: an HTTP engine's first update (base weights -> the join version) must not wait for
    # an evaluation of version 0 the replacement will never run; at the join, the due versions before it that have
    # no result are posted as missed (one its predecessor posted is kept), and the later ones stay due.
    from transformers import AutoTokenizer

    cfg = config(model_dir, tmp_path)
    store = dist.HashStore()
    store.set(result_key(1, 0), json.dumps({"scored": "by the predecessor"}))
    evaluator = VersionEvaluator(cfg, store, AutoTokenizer.from_pretrained(model_dir), share=0, shares=1,
                                 first_version=0, staged=False, joined=False)
    evaluator.hold_update(0, should_stop=lambda: pytest.fail("held the replacement's first update"))
    evaluator.join(3)
    assert json.loads(store.get(result_key(1, 0))) == {"scored": "by the predecessor"}
    for version in (0, 2):
        assert "was replaced before it evaluated version" in json.loads(store.get(result_key(version, 0)))["missed"]
    assert evaluator.pending == [3, 4] and not store.check([result_key(3, 0)])
