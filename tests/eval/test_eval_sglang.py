"""Evaluation on an HTTP engine: megarl's SGLang-compatible server (a real process) and a stand-in learner (a real
process) publishing over SGLang's weight-update group while an evaluation runs. The score is of one version:
the update waits (VersionEvaluator.hold_update) until the evaluation is done, and every token's version, as the
server labelled it, is checked from the eval records."""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from megarl.config.load import load_config
from megarl.distributed.sglang_publish import free_port
from megarl.distributed.ranks import Topology
from megarl.eval.sampler_side import VersionEvaluator, result_key
from megarl.observe.jsonl import read_jsonl
from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.sglang_engine import SGLangEngine, SGLangWeightFollower
from tests.helpers import REPO, save_tiny_qwen2
from tests.sampler.sglang_support import start_learner

DEMO = str(REPO / "configs" / "demo.yaml")


def test_an_sglang_evaluation_is_of_one_version_while_a_publish_lands(tmp_path):
    from transformers import AutoTokenizer

    model_dir = save_tiny_qwen2(tmp_path / "model", False, vocab_size=264, tokenizer=True)
    cfg = load_config(DEMO, [f"model.path={model_dir}", f"run.dir={tmp_path / 'run'}", "sampler.engine=sglang",
                             "run.steps=2", "eval.every_steps=1", "eval.sets=[{name: heldout, prompts: 6}]",
                             "eval.samples=3", "eval.k=2", "sampler.max_seq_len=64", "sampling.max_new_tokens=16",
                             "sampler.max_running=8"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = SGLangEngine.from_config(cfg, Topology(rank=1, world_size=2, num_learners=1, num_samplers=1), model_dir)
    store_port = free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    learner = start_learner(model_dir, tmp_path / "w.safetensors", free_port("127.0.0.1"), 2, "flattened_bucket", 1,
                            store_port=store_port)
    evaluator = VersionEvaluator(cfg, store, tokenizer, share=0, shares=1, first_version=0, staged=False)
    published, stop = [], threading.Event()
    follower = SGLangWeightFollower(engine, store, rank_offset=1, on_published=lambda v, e: published.append(v),
                                    should_stop=stop.is_set,
                                    before_update=lambda version: evaluator.hold_update(version, stop.is_set)).start()
    deadline = time.monotonic() + 120

    def publish_during_eval():  # after the evaluation's first step: the learner publishes version 1
        if not store.check(["test/go"]):
            store.set("test/go", "1")
            while not (evaluator.held or published):  # the update is waiting (or, unheld, has landed)
                assert follower.error is None and time.monotonic() < deadline, follower.error
                time.sleep(0.01)

    try:
        while engine.group_name is None:  # the server joined the learner's update group
            assert follower.error is None and time.monotonic() < deadline, follower.error
            time.sleep(0.01)
        for i in range(2):  # training requests decoding on the same server throughout
            engine.add_request(GenerationRequest(f"train/{i}", [100, 45, 107, 61], SamplingParams(1.0, 1.0, 0, 60), ()))
        evaluator.before_step(engine, publish_during_eval)  # version 0, while version 1 is published
        assert evaluator.pending == [1, 2] and store.check(["test/go"])
        while not published:  # released once version 0 was scored
            assert follower.error is None and time.monotonic() < deadline, follower.error
            time.sleep(0.01)
        evaluator.before_step(engine, lambda: None)  # version 1
        training = []
        while engine.num_unfinished:
            assert time.monotonic() < deadline
            training += engine.step()
        assert learner.wait(60) == 0, learner.stdout.read()
    finally:
        stop.set()
        follower.join(10)
        learner.kill()
        evaluator.close()
        engine.close()
    assert follower.error is None and published == [1] and engine.version == 1
    assert json.loads(store.get(result_key(0, 0)))["publishes_during"] == 1  # the update waited for the evaluation
    assert json.loads(store.get(result_key(1, 0)))["publishes_during"] == 0
    samples = read_jsonl(tmp_path / "run" / "eval_samples.jsonl")
    assert len(samples) == 2 * 6 * (3 + 1) and sorted({r["eval_version"] for r in samples}) == [0, 1]
    for r in samples:  # per token, as the server labelled them
        assert r["versions"] and set(r["versions"]) == {r["eval_version"]}, (r["eval_version"], r["versions"])
    assert len(training) == 2 and all(set(c.versions) <= {0, 1} for c in training)
