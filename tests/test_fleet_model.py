"""The fleet model: exact where theory is exact, long tails make sync decay, tokens are conserved,
staleness stays bounded, and calibration reads what a run's timeline recorded."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from megarl.fleet_model import (
    EmpiricalLengths, EngineModel, FleetParams, LogNormalLengths, calibrate, engine_rates, measured_summary,
    replay_engine_steps, simulate, summarise)
from megarl.observe.timeline import Timeline
from megarl.protocols import GenerationRequest, SamplingParams
from megarl.sampler.engine import BuiltinEngine
from tests.sampler import make_tiny_model

BASE = FleetParams(
    engine=EngineModel(step_base_s=0.01, step_per_seq_s=0.001, max_running=8),
    lengths=EmpiricalLengths((50,)), batch_samples=16, group_size=4, prompt_tokens=0.0,
    train_token_s=1e-5, train_step_s=0.05, publish_bytes=1e6, publish_bytes_per_s=1e8, publish_latency_s=0.0,
    swap_stall_s=0.02, ingest_s=0.03, log_s=0.01, resume_s=0.005, max_lag=2)
LONG_TAIL = dataclasses.replace(BASE, lengths=LogNormalLengths(mean=200, p99=1600, cap=2048), batch_samples=64)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("fleet"), "qwen2")
    return BuiltinEngine.from_pretrained(str(path), max_running=3, max_seq_len=32)


def drive(engine: BuiltinEngine, lengths: list[int], ids: list[str] | None = None):
    """Queue greedy requests that stop only at their length; yield the tokens of each engine step."""
    for i, n in enumerate(lengths):
        rid = ids[i] if ids else str(i)
        engine.add_request(GenerationRequest(rid, [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=n)))
    while engine.num_unfinished:
        before = engine.stats()["tokens_decoded"]
        engine.step()
        yield engine.stats()["tokens_decoded"] - before


def test_replay_follows_the_builtin_engine_step_for_step(engine):
    assert replay_engine_steps([3, 1, 2], max_running=2).tolist() == [3, 3]  # admit+decode, then admit 1 more
    lengths = [5, 1, 2, 9, 3, 3, 7, 1, 4, 12]
    assert list(drive(engine, lengths)) == replay_engine_steps(lengths, max_running=3).tolist()


def test_constant_lengths_match_theory_sync():
    p, samplers = BASE, 2  # 16 samples on 2 engines: all 8 per engine run at once, for 49 steps
    result = simulate(p, "sync", samplers, 1, steps=4)
    b = p.batch_samples // samplers
    generate = (50 - 1) * p.engine.step_s(b) + p.engine.step_per_seq_s * b  # prefill token, then 49 steps
    train = p.train_s(p.batch_samples * 50, learners=1)
    cycle = generate + p.ingest_s + train + p.publish_s(samplers) + p.resume_s
    s = summarise(result, skip_steps=1)  # from the first publish on: every cycle is the same
    assert s["step_s"] == pytest.approx(cycle, rel=1e-9)
    assert s["sampler_busy"] == pytest.approx(generate / cycle, rel=1e-9)
    assert s["learner_busy"] == pytest.approx((train + p.publish_s(samplers)) / cycle, rel=1e-9)


def test_constant_lengths_match_theory_pipeline():
    # 2 engines x 8 slots = one batch per wave; the learner (0.13 s a step) is faster than a wave, so
    # each wave carries exactly one publish, i.e. one swap stall.
    p = BASE
    result = simulate(p, "pipeline", 2, 1, steps=8)
    wave = (50 - 1) * p.engine.step_s(8) + p.engine.step_per_seq_s * 8
    period = wave + p.swap_stall_s
    s = summarise(result, skip_steps=3)
    assert s["step_s"] == pytest.approx(period, rel=1e-9)
    assert s["sampler_busy"] == pytest.approx(wave / period, rel=1e-9)
    assert s["learner_busy"] == pytest.approx((p.train_s(16 * 50, 1) + p.publish_s(2)) / period, rel=1e-9)
    assert s["lag_max"] == 1 and s["dropped_frac"] == 0.0


def test_sync_throughput_decays_over_a_long_tailed_generation_phase():
    def phase_rates(params):
        result = simulate(params, "sync", 8, 8, steps=1, colocated=True)
        end = result.segments[:, 2].max()  # the last rollout's last token
        edges = np.linspace(0, end, 41)
        return engine_rates(result, edges).sum(0), params.engine.tokens_per_s(8) * 8

    rates, peak = phase_rates(LONG_TAIL)
    assert rates[0] == pytest.approx(peak, rel=0.05)  # 8 requests per engine at first
    assert rates[-10:].mean() < 0.15 * peak  # the last quarter: a few long rollouts
    flat, _ = phase_rates(dataclasses.replace(LONG_TAIL, lengths=EmpiricalLengths((200,))))
    assert flat.min() == pytest.approx(flat.max(), rel=0.1)  # equal lengths: no tail, no decay


@pytest.mark.parametrize("mode", ["sync", "pipeline"])
def test_every_generated_token_belongs_to_a_request(mode):
    result = simulate(LONG_TAIL, mode, 4, 2, steps=6, seed=3)
    generated = result.segments[:, 3].sum()
    assert generated == result.finished_tokens + result.in_flight_tokens
    trained = sum(r.completion_tokens for r in result.steps)
    if mode == "sync":  # the run ends at a publish: every request of every batch was trained
        assert result.in_flight_tokens == 0 and generated == trained
    else:
        assert trained <= result.finished_tokens and result.in_flight_tokens > 0


def test_pipeline_staleness_never_exceeds_max_lag():
    finish = dataclasses.replace(LONG_TAIL, queue_order="finish")
    tight = simulate(dataclasses.replace(finish, max_lag=1), "pipeline", 8, 1, steps=20, seed=1)
    assert max(r.lag_max for r in tight.steps) <= 1
    assert tight.drops  # the long tail did go stale: the bound was enforced, not idle
    loose = simulate(dataclasses.replace(finish, max_lag=50), "pipeline", 8, 1, steps=20, seed=1)
    assert not loose.drops and max(r.lag_max for r in loose.steps) > 1


def test_groups_sent_by_deadline_or_start_order_are_not_overtaken_into_staleness():
    """One sampler, a long tail of lengths: sent as they finish, short groups overtake long ones, which
    reach the learner more than max_lag versions old and are dropped; sent in start order or by deadline
    (megarl/rollout/send_order.py), the staleness budget bounds every group's age by max_lag and none is
    dropped, and the same steps train more tokens (the long completions are in them)."""
    runs = {order: simulate(dataclasses.replace(LONG_TAIL, max_lag=1, queue_order=order), "pipeline", 1, 1,
                            steps=30, seed=2) for order in ("finish", "start", "deadline")}
    assert runs["finish"].drops and not runs["start"].drops and not runs["deadline"].drops
    for order in ("start", "deadline"):
        assert max(r.lag_max for r in runs[order].steps) <= 1
        assert sum(r.completion_tokens for r in runs[order].steps) > sum(r.completion_tokens for r in runs["finish"].steps)
    with pytest.raises(ValueError, match="queue_order"):
        dataclasses.replace(LONG_TAIL, queue_order="random")


def test_masking_stale_tokens_trains_every_group_that_holds_a_fresh_token():
    """The long tail sent as it finishes (megarl's algo.stale): drop_group loses whole groups; mask_tokens trains
    them without their stale tokens' gradient, so more samples and more tokens are trained per second, and what is
    masked is a share of the trained groups' tokens, never a whole batch."""
    finish = dataclasses.replace(LONG_TAIL, max_lag=1, queue_order="finish")
    runs = {policy: simulate(dataclasses.replace(finish, stale=policy), "pipeline", 8, 1, steps=20, seed=1)
            for policy in ("drop_group", "mask_tokens")}
    dropped, masked = (summarise(runs[policy], skip_steps=5) for policy in ("drop_group", "mask_tokens"))
    assert runs["drop_group"].drops and not runs["mask_tokens"].drops
    assert dropped["masked_token_frac"] == 0 < masked["masked_token_frac"] < 1
    assert masked["samples_per_s"] > dropped["samples_per_s"]
    assert masked["trained_tokens_per_s"] > dropped["trained_tokens_per_s"]
    assert all(0 <= r.masked_tokens < r.completion_tokens for r in runs["mask_tokens"].steps)
    assert any(r.masked_tokens for r in runs["mask_tokens"].steps)
    with pytest.raises(ValueError, match="stale"):
        dataclasses.replace(LONG_TAIL, stale="keep")


def test_lag_counts_from_a_groups_oldest_token():
    # 2 slots, groups of 4: every group runs in two halves, and the learner (faster than a half)
    # publishes between them, so each trained group has tokens one version older than its newest.
    p = dataclasses.replace(BASE, engine=dataclasses.replace(BASE.engine, max_running=2), batch_samples=4,
                            lengths=EmpiricalLengths((30,)), max_lag=3)
    result = simulate(p, "pipeline", 1, 1, steps=6)
    assert [r.lag_max for r in result.steps[1:]] == [1] * 5


def test_a_seed_fixes_the_run():
    a, b, c = (simulate(LONG_TAIL, "pipeline", 4, 2, steps=5, seed=s) for s in (7, 7, 8))
    assert np.array_equal(a.segments, b.segments) and a.spans == b.spans
    assert not np.array_equal(a.segments, c.segments)


def test_lognormal_lengths_have_the_asked_mean_and_p99():
    lengths = LogNormalLengths(mean=2000, p99=16000, cap=10**9).sample(np.random.default_rng(0), 400_000)
    assert lengths.mean() == pytest.approx(2000, rel=0.02)
    assert np.percentile(lengths, 99) == pytest.approx(16000, rel=0.03)
    with pytest.raises(ValueError, match="no lognormal"):
        LogNormalLengths(mean=2000, p99=1000, cap=4096).mu_sigma()


def write_sync_run(run_dir, engine, a, c, train_token_s, publish_s, ingest_s, log_s, resume_s):
    """A 4-step sync run as megarl writes it: the real engine generates each batch; the clock is
    synthetic (a step of n tokens takes a + c*n), so the truth is known exactly."""
    group_size, groups, rng = 2, 3, np.random.default_rng(0)
    cfg = {"algo": {"mode": "sync", "prompts_per_step": groups, "group_size": group_size, "sync_epochs": 1,
                    "max_lag": 1},
           "sampler": {"max_running": 3}, "learner": {"tp": 1, "pp": 1, "dp": 1}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    sampler = Timeline(run_dir, "sampler1", slice_s=0.004)  # ~1-2 steps a slice: many batch sizes
    learner = Timeline(run_dir, "learner0")
    metrics, rollouts, t, wait_from = [], [], 0.0, 0.0
    for step in range(4):
        lengths = rng.integers(1, 12, groups * group_size).tolist()
        ids = [f"s0-g{step * groups + g}/{j}" for g in range(groups) for j in range(group_size)]
        for n in drive(engine, lengths, ids):
            sampler.tokens(n, t, t + a + c * n)
            t += a + c * n
        tokens = sum(lengths)
        train_start = t + ingest_s
        publish_start = train_start + train_token_s * tokens
        t = publish_start + publish_s
        for kind, start, end in [("wait", wait_from, train_start), ("train", train_start, publish_start),
                                 ("publish", publish_start, t)]:
            learner.span(kind, start, end)
        wait_from, t = t + log_s, t + resume_s
        metrics.append({"step": step, "num_tokens": tokens, "publish_bytes": 1000, "samples/total": len(lengths),
                        "sampler1/swaps": step + 1, "sampler1/swap_time_s": 1e-4 * (step + 1)})
        rollouts += [{"trained_at_step": step, "group_id": rid.split("/")[0], "sampler_rank": 1,
                      "token_ids": [0] * n} for rid, n in zip(ids, lengths)]
    sampler.close()
    learner.close()
    for name, rows in (("metrics.jsonl", metrics), ("rollouts.jsonl", rollouts)):
        (run_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rollouts, t - resume_s


def test_calibration_recovers_what_the_timeline_recorded(tmp_path, engine):
    rollouts, end = write_sync_run(tmp_path, engine, a=0.002, c=0.0005, train_token_s=1e-4, publish_s=0.01,
                                   ingest_s=0.02, log_s=0.003, resume_s=0.005)
    cal = calibrate(tmp_path)
    p = cal.params
    assert cal.report["phases_used"] == 4 and cal.report["phases_skipped"] == 0
    assert (p.engine.step_base_s, p.engine.step_per_seq_s) == pytest.approx((0.002, 0.0005), rel=1e-6)
    assert p.engine.max_running == 3 and (cal.samplers, cal.learners, cal.steps) == (1, 1, 4)
    assert (p.batch_samples, p.group_size, p.max_lag, p.epochs) == (6, 2, 1, 1)
    assert sorted(p.lengths.values) == sorted(len(r["token_ids"]) for r in rollouts)
    assert p.train_token_s == pytest.approx(1e-4) and p.train_jitter == pytest.approx([1.0] * 4)
    assert p.publish_s(1) == pytest.approx(0.01) and p.publish_bytes == 1000
    assert (p.ingest_s, p.log_s, p.resume_s, p.swap_stall_s) == pytest.approx((0.02, 0.003, 0.005, 1e-4))
    measured = measured_summary(tmp_path)
    assert measured["steps_per_s"] == pytest.approx(4 / end)


def test_calibration_refuses_a_pipeline_run(tmp_path, engine):
    write_sync_run(tmp_path, engine, 0.002, 0.0005, 1e-4, 0.01, 0.02, 0.003, 0.005)
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    cfg["algo"]["mode"] = "pipeline"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="needs a sync-mode run"):
        calibrate(tmp_path)
    with pytest.raises(ValueError, match="missing rollouts.jsonl"):
        (tmp_path / "rollouts.jsonl").unlink()
        calibrate(tmp_path)
