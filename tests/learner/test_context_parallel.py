"""Context parallelism (learner.cp, megarl.learner.context_parallel): the zig-zag split, each rank's mask rows and the
row shares of the critic and the teacher, and real gloo ranks (forked) whose log-probs, gradients, few-step metrics
and published weights are the cp = 1 learner's, with TP, PP, DP, LoRA, the critic, the distillation teacher, and a
mixture of experts under EP and r3."""
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megarl.algo import values
from megarl.algo.config import LossConfig
from megarl.learner import context_parallel, packing
from megarl.protocols import TrainBatch
from tests.helpers import FP32_UNIT_ROUNDOFF, LEARNER_TOL, forked_ranks, save_tiny_moe, save_tiny_qwen2, save_tiny_qwen3

VOCAB, ROWS, S, PROMPT = 64, 16, 22, 5


def cp_width(width: int, cp: int) -> int:
    """`width` padded to a multiple of 2 * cp, as the learner pads a micro-batch (sequence_parallel.pad_micro_batch)."""
    return width + -width % (2 * cp)
LOSS = {"entropy_coef": 0.01, "kl_coef": 0.05}  # the entropy's gradient and the frozen reference's pass too


def test_zigzag_columns_cover_the_width_once_and_balance_causal_work():
    width, cp = 24, 3
    parts = [context_parallel.local_columns(width, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(width))
    assert torch.equal(context_parallel.key_columns(width, cp), torch.cat(parts))
    # A causal query at column c attends to c + 1 keys: every rank gets the same total.
    assert len({int((p + 1).sum()) for p in parts}) == 1
    with pytest.raises(ValueError, match="multiple of 2 \\* cp"):
        context_parallel.local_columns(22, 2, 0)


@pytest.mark.parametrize("slice_elements", [packing.MASK_SLICE_ELEMENTS, 25])
def test_a_ranks_mask_is_its_rows_of_the_whole_mask_in_the_gathered_key_order(monkeypatch, slice_elements):
    """(built in slices of queries, or all at once: the same mask)"""
    monkeypatch.setattr(packing, "MASK_SLICE_ELEMENTS", slice_elements)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (6, 10), generator=g)
    ids[:3, :4] = ids[0, :4]  # three rows sharing a prefix
    lengths = torch.tensor([10, 7, 9, 4, 6, 3])
    mb = packing.pack({"input_ids": ids}, lengths, share_prefixes=True)
    width = cp_width(mb["packed_ids"].shape[1] + 1, 2)
    keys = context_parallel.key_columns(width, 2)
    for window in (None, 3):
        whole = packing.attention_mask(mb, width, window=window)
        causal = packing.causal_mask(width, window=window)
        for rank in range(2):
            mine = context_parallel.local_columns(width, 2, rank)
            assert torch.equal(packing.attention_mask(mb, width, window=window, queries=mine, keys=keys),
                               whole[:, :, mine][:, :, :, keys])
            assert torch.equal(packing.causal_mask(width, window=window, queries=mine, keys=keys),
                               causal[:, :, mine][:, :, :, keys])


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_the_packed_mask_is_each_rows_causal_path(share, window):
    """packing.attention_mask against the rows themselves: row i's token t (at column c_i[t] of its packed row)
    attends to c_i[max(0, t - window + 1)..t] and nothing else; a position no row placed attends to itself."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 3, (9, 12), generator=g)
    ids[:4, :5] = ids[0, :5]
    lengths = torch.tensor([12, 9, 5, 11, 3, 7, 12, 2, 6])
    mb = packing.pack({"input_ids": ids}, lengths, share_prefixes=share)
    count, packed = mb["packed_ids"].shape
    width = packed + 3
    expected = torch.zeros(count, width, width, dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        r, cols = divmod(int(mb["unpack_index"][i, 0]), packed)[0], (mb["unpack_index"][i, :n] % packed).tolist()
        for t in range(n):
            expected[r, cols[t], cols[max(0, t - window + 1) if window else 0:t + 1]] = True
    expected.diagonal(dim1=1, dim2=2).fill_(True)
    assert torch.equal(~packing.attention_mask(mb, width, window=window)[:, 0], expected)


def _batches(count: int) -> list[TrainBatch]:
    """Groups of 4 rows sharing a prompt (and pairs of them their first completion tokens), long-tailed lengths; each
    row's reward (the critic's) on its last token."""
    out = []
    for seed in range(count):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB, (ROWS, S), generator=g)
        for group in range(0, ROWS, 4):
            ids[group:group + 4, :PROMPT] = ids[group, :PROMPT]
            ids[group + 1, :PROMPT + 3] = ids[group, :PROMPT + 3]
        lengths = torch.randint(2, S - PROMPT + 1, (ROWS,), generator=g)
        mask = torch.zeros(ROWS, S)
        for b in range(ROWS):
            mask[b, PROMPT:PROMPT + lengths[b]] = 1.0
            ids[b, PROMPT + lengths[b]:] = 0
        mu = -2.0 + 0.3 * torch.randn(ROWS, S, generator=g)
        advantages = torch.randn(ROWS, 1, generator=g).expand(ROWS, S)
        rewards = values.terminal_rewards((ids[:, PROMPT] % 2).float(), mask)
        out.append(TrainBatch(input_ids=ids, loss_mask=mask, behaviour_logprobs=mu * mask,
                              versions=torch.where(mask > 0, 0, -1), advantages=advantages * mask, learner_version=0,
                              rewards=rewards))
    return out


def _launch(model_dir: str, batches: list, tmp_path: Path, layouts: dict, nproc: int) -> subprocess.Popen:
    torch.save(batches, tmp_path / "batches.pt")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(  # the ranks forked from one warmed process (the layouts' math is what is checked)
        forked_ranks(nproc, Path(__file__).with_name("cp_worker.py"), model_dir, str(tmp_path / "batches.pt"),
                     str(tmp_path), json.dumps(layouts), timeout_s=540),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _results(proc, tmp_path: Path, layouts: dict, nproc: int, timeout: float) -> dict[str, list[dict]]:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return {name: [torch.load(tmp_path / f"{name}.rank{r}.pt") for r in range(nproc)] for name in layouts}


def _reference(model_dir: str, layout: dict, batches: list) -> dict:
    """The one-rank (cp = tp = pp = dp = ep = 1) learner's results of `layout` (cp_worker.run_layout), here."""
    from tests.learner.cp_worker import run_layout

    one_rank = {k: v for k, v in layout.items() if k not in ("cp", "tp", "pp", "dp", "ep", "save")}
    return run_layout(model_dir, one_rank, batches)[1]


def _assert_matches(got: dict, ref: dict, name: str, layout_metrics: tuple = ()) -> None:
    """(`layout_metrics`: metrics of how the rows were cut, which another DP size cuts differently)"""
    assert (got["logprobs"] - ref["logprobs"]).abs().max().item() <= LEARNER_TOL, name
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    assert scale > 0
    for param, grad in ref["grads"].items():  # fp32 sums in another order: relative to the largest gradient
        assert (got["grads"][param] - grad).abs().max().item() <= 1e-5 * scale, (name, param)
    for step, (mine, theirs) in enumerate(zip(got["metrics"], ref["metrics"], strict=True)):
        for key, value in theirs.items():
            if key.endswith("_s") or key in layout_metrics:  # (timings)
                continue
            assert abs(mine[key] - value) <= 1e-5 * max(1.0, abs(value)), (name, step, key)


def _assert_loss_curve(got: dict, ref: dict, batches: list[TrainBatch], name: str) -> None:
    """Every step's loss within the fp32 bound of a run that differs from the reference only in the order of its sums.

    A step's loss sums N token terms: evaluated in another order it moves by about sqrt(N) u |L| (u = 2^-24, the
    probabilistic bound `fp32_logprob_tol` uses). Each gradient entry is such a sum too (scale G, the largest entry),
    so it moves by e = sqrt(N) u G; AdamW turns a gradient g_i + e into a step that differs by at most about
    lr * e / |g_i| (its update is lr * m / sqrt(v): scale-free), and the loss changes by g_i times that: lr * e per
    weight and step, however small g_i. After k steps the weights' differences move the loss by at most
    k * lr * P * e (P weights), to first order. So |L_k - L_k'| <= sqrt(N) u (|L_k| + k lr P G)."""
    tokens = max(int(b.loss_mask.sum()) for b in batches)
    weights = sum(g.numel() for g in ref["grads"].values())
    largest = max(float(g.abs().max()) for g in ref["grads"].values())
    rounding = tokens ** 0.5 * FP32_UNIT_ROUNDOFF
    drift = 0.0  # sum over the steps so far of lr * P * G
    for step, (mine, theirs) in enumerate(zip(got["metrics"], ref["metrics"], strict=True)):
        bound = rounding * (abs(theirs["loss"]) + drift)
        assert abs(mine["loss"] - theirs["loss"]) <= bound, (name, step, mine["loss"], theirs["loss"], bound)
        drift += theirs["lr"] * weights * largest


def _assert_published(got: dict, ref: dict, name: str) -> None:
    """The tensors published after the steps: the cp = 1 learner's, within 1e-5 of each one's largest entry (Adam
    normalises each gradient entry, so the fp32 noise of a gradient becomes noise of its weight's step)."""
    assert set(got["published"]) == set(ref["published"]), name
    for tensor, value in ref["published"].items():
        error = (got["published"][tensor] - value).abs().max().item()
        assert error <= 1e-5 * max(1.0, value.abs().max().item()), (name, tensor, error)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), tie_word_embeddings=True, vocab_size=VOCAB))


def test_cp2_gives_the_cp1_logprobs_gradients_and_steps(model_dir, world, tmp_path):
    """cp=2 on packed, prefix-shared rows in two micro-batches (with the entropy bonus and the KL reference), and on
    unpacked rows with full activation recomputation (the K/V gathers run again in the backward): the cp=1 per-token
    log-probs, first-step gradients of every parameter and three steps' loss,
    grad norm and statistics; the cp=2 learner's checkpoint resumes its weights at its layout. And 20 optimizer steps
    over the three packed, prefix-shared batches in turn (one micro-batch a step): every step's loss within the bound
    of fp32 sums in another order (_assert_loss_curve), its grad norm and statistics within 1e-5, the weights
    published after them within 1e-5 of each tensor's largest entry."""
    batches = _batches(3)
    layouts = {"cp2_packed": {"cp": 2, "micro_batch_size": 8, "loss": LOSS, "save": True},
               "cp2_unpacked_recompute": {"cp": 2, "micro_batch_size": 16, "pack_sequences": False,
                                          "recompute_activations": "full"},
               "cp2_20_steps": {"cp": 2, "micro_batch_size": 16, "loss": LOSS, "steps": 20}}
    proc = _launch(model_dir, batches, tmp_path, layouts, nproc=2)
    refs = {name: _reference(model_dir, layout, batches) for name, layout in layouts.items()}
    curve = [m["loss"] for m in refs["cp2_20_steps"]["metrics"]]
    # (the curve moves by far more than the bound: the same batch's loss at steps 0 and 18)
    assert abs(curve[18] - curve[0]) > 100 * max(abs(curve[0]), 1.0) * 1e-5
    for name, ranks in _results(proc, tmp_path, layouts, nproc=2, timeout=600).items():
        assert sorted(r["cp_rank"] for r in ranks) == [0, 1]
        for rank in ranks:
            _assert_matches(rank, refs[name], name)
            if "steps" in layouts[name]:
                _assert_loss_curve(rank, refs[name], batches, name)
                _assert_published(rank, refs[name], name)
            if layouts[name].get("save"):  # (its checkpoint resumed at its own layout)
                _assert_published({"published": rank["resumed_published"]}, rank, f"{name} resumed")


def test_the_deepspeed_learner_refuses_context_parallelism(model_dir, world):
    """Inside a launch, as before it (megarl.config.load): the DeepSpeed learner has no context parallelism."""
    from megarl.config.schema import LearnerConfig
    from megarl.learner.deepspeed import DeepSpeedLearner

    with pytest.raises(ValueError, match="context parallelism is the megatron learner's"):
        DeepSpeedLearner(model_dir, LearnerConfig(backend="deepspeed", cp=2), LossConfig())


def _with_routes(batches: list[TrainBatch], layers: int, experts: int, top_k: int) -> list[TrainBatch]:
    """The batches with recorded routes: k distinct experts per token and layer, drawn at random (what replay feeds
    the routers; the learner's own choices differ from them, so the router agreement is a real count)."""
    g = torch.Generator().manual_seed(5)
    return [dataclasses.replace(b, routes=torch.rand(*b.input_ids.shape, layers, experts, generator=g)
                                .argsort(-1)[..., :top_k].to(torch.uint8)) for b in batches]


def _with_all_grads(rank: dict, ranks: list[dict]) -> dict:
    """A rank's results with the gradients of every parameter under its global name, its own and, for the experts
    other expert-parallel ranks hold, theirs."""
    grads = {name: grad for other in ranks for name, grad in other["global_grads"].items()}
    return {**rank, "grads": {**grads, **rank["global_grads"]}}


def test_cp2_with_tp2_pp2_and_dp2_gives_the_cp1_logprobs_gradients_and_steps(model_dir, world, tmp_path):
    """cp=2 x tp=2 (4 ranks; vocab-parallel log-probs and entropies per CP rank, each TP rank's heads' keys and values
    gathered over its CP group) and cp=2 x pp=2 (each stage's activations of its CP rank's positions sent on, the
    log-probs broadcast from the last stage) and cp=2 x dp=2 (gradients summed over the DP x CP group) on packed,
    prefix-shared rows: the cp=1, tp=1 log-probs, gradients (the two stages' together) and steps. And a Mixtral at
    cp=2 x tp=2 x ep=2 under r3 (sequence parallelism: each CP rank's columns, padded to 2 * cp chunks of a multiple
    of tp, split again over its TP ranks, whose routers replay their positions' routes): the cp=1 learner's results
    and published weights. (The dense layouts ignore the batches' routes.)"""
    moe_dir = str(save_tiny_moe(tmp_path / "mixtral", "mixtral", vocab_size=VOCAB))
    batches = _with_routes(_batches(2), layers=2, experts=4, top_k=2)
    layouts = {"cp2_tp2": {"cp": 2, "tp": 2, "micro_batch_size": 8, "loss": LOSS},
               "cp2_pp2": {"cp": 2, "pp": 2, "micro_batch_size": 8, "loss": LOSS},
               "cp2_dp2": {"cp": 2, "dp": 2, "micro_batch_size": 8, "loss": LOSS},
               "moe_cp2_tp2_ep2_r3": {"cp": 2, "tp": 2, "ep": 2, "micro_batch_size": 8, "loss": LOSS,
                                      "model_dir": moe_dir, "routing_replay": "r3"}}
    proc = _launch(model_dir, batches, tmp_path, layouts, nproc=4)
    ref = _reference(model_dir, layouts["cp2_tp2"], batches)
    moe_ref = _reference(moe_dir, layouts["moe_cp2_tp2_ep2_r3"], batches)
    results = _results(proc, tmp_path, layouts, nproc=4, timeout=600)
    ranks = results["cp2_tp2"]
    assert sorted((r["tp_rank"], r["cp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in ranks:
        _assert_matches(rank, ref, "cp2_tp2")
    ranks = results["cp2_pp2"]
    assert sorted((r["pp_rank"], r["cp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for cp_rank in (0, 1):
        stages = [r for r in ranks if r["cp_rank"] == cp_rank]
        # (each stage holds its own layers' gradients; the tied embedding's on both)
        merged = {**stages[0], "grads": {name: grad for r in stages for name, grad in r["global_grads"].items()}}
        _assert_matches(merged, ref, "cp2_pp2")
    ranks = results["cp2_dp2"]  # (each DP rank's 8 rows in one micro-batch, the reference's 16 in two)
    assert sorted((r["dp_rank"], r["cp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in ranks:
        _assert_matches(rank, ref, "cp2_dp2", layout_metrics=("padding_frac", "shared_frac"))
    ranks = results["moe_cp2_tp2_ep2_r3"]
    for rank in ranks:  # (expert parallelism cuts the rows again: test_cp2_trains_a_mixture_of_experts_...)
        _assert_matches(_with_all_grads(rank, ranks), moe_ref, "moe_cp2_tp2_ep2_r3",
                        layout_metrics=("padding_frac", "shared_frac"))
        _assert_published(rank, moe_ref, "moe_cp2_tp2_ep2_r3")


def test_cp2_trains_the_cp1_lora_adapter(model_dir, world, tmp_path):
    """learner.lora at cp=2 on packed, prefix-shared rows (the base frozen, the KL reference the base): each CP rank's
    adapter gradients are its positions' share, which megatron's DDP sums over the DP x CP group as it does the
    base weights'; the cp=1 log-probs, adapter gradients, two steps' metrics and the adapter published after them."""
    batches = _batches(2)
    layouts = {"cp2_lora": {"cp": 2, "micro_batch_size": 8, "loss": LOSS, "lora": {"rank": 4, "alpha": 8.0}}}
    proc = _launch(model_dir, batches, tmp_path, layouts, nproc=2)
    ref = _reference(model_dir, layouts["cp2_lora"], batches)
    assert ref["grads"] and all(".lora." in name for name in ref["grads"])  # (only the adapter trains)
    assert ref["published"] and all("lora_" in name for name in ref["published"])
    for rank in _results(proc, tmp_path, layouts, nproc=2, timeout=600)["cp2_lora"]:
        _assert_matches(rank, ref, "cp2_lora")
        _assert_published(rank, ref, "cp2_lora")


def test_row_shares_cover_the_rows_once_in_order():
    for rows, size in ((8, 2), (5, 2), (1, 2), (7, 3)):
        shares = [context_parallel.row_share(rows, size, rank) for rank in range(size)]
        assert [i for share in shares for i in range(rows)[share]] == list(range(rows))
        assert max(len(range(rows)[sh]) for sh in shares) - min(len(range(rows)[sh]) for sh in shares) <= 1


def test_cp2_trains_the_cp1_critic(model_dir, world, tmp_path):
    """algo.advantage.estimator=gae at cp=2: the CP ranks of a DP rank split each micro-batch's rows for the value model
    (transformers, replicated), gather the values back per token and sum the critic's gradients and statistics, so
    the GAE advantages, value targets and critic step are the cp=1 ones; the policy's log-probs, gradients and two
    steps' metrics (critic/* among them: the second step's value loss is the first step's update's) equal cp=1's,
    with micro-batches of 8 rows and of one row (a CP rank with no row of it)."""
    batches = _batches(2)
    layouts = {"cp2_critic": {"cp": 2, "micro_batch_size": 8, "critic": {"lr": 1e-2, "lam": 0.9}},
               "cp2_critic_one_row": {"cp": 2, "micro_batch_size": 1, "critic": {"lr": 1e-2, "lam": 0.9}}}
    proc = _launch(model_dir, batches, tmp_path, layouts, nproc=2)
    refs = {name: _reference(model_dir, layout, batches) for name, layout in layouts.items()}
    assert refs["cp2_critic"]["metrics"][1]["critic/value_loss"] > 0
    for name, ranks in _results(proc, tmp_path, layouts, nproc=2, timeout=600).items():
        for rank in ranks:
            _assert_matches(rank, refs[name], name)


def test_cp2_distils_from_the_teacher_as_cp1(model_dir, world, tmp_path):
    """On-policy distillation at cp=2 (a Qwen3 teacher, half the advantage the task's): the CP ranks of a DP rank split
    each micro-batch's rows for the teacher (transformers, replicated on every rank that computes a loss) and gather
    its log-probs back per token, and each rank's loss reads them against the student's, which the CP group gathers
    per token too; the cp=1 log-probs, gradients and two steps' metrics (distill/* among them), with micro-batches of
    8 rows and of one row (a CP rank with no row of it)."""
    teacher = str(save_tiny_qwen3(tmp_path / "teacher", vocab_size=VOCAB))
    batches = _batches(2)
    distill = {"teacher": teacher, "coef": 1.0, "reward_weight": 0.5}
    layouts = {"cp2_distill": {"cp": 2, "micro_batch_size": 8, "distill": distill},
               "cp2_distill_one_row": {"cp": 2, "micro_batch_size": 1, "distill": distill}}
    proc = _launch(model_dir, batches, tmp_path, layouts, nproc=2)
    refs = {name: _reference(model_dir, layout, batches) for name, layout in layouts.items()}
    assert any(key.startswith("distill/") and key != "distill/teacher_s" for key in refs["cp2_distill"]["metrics"][0])
    for name, ranks in _results(proc, tmp_path, layouts, nproc=2, timeout=600).items():
        for rank in ranks:
            _assert_matches(rank, refs[name], name)


def test_cp2_trains_a_mixture_of_experts_as_cp1_with_expert_parallelism_and_r3(tmp_path, world):
    """A Mixtral (4 experts, top-2) at cp=2 on packed, prefix-shared rows with the entropy bonus and the KL reference:
    each CP rank's routers route its own positions (the router agreement gathers their choices per token), at cp=2 x
    ep=2 the two CP ranks are the EP group (each holds 2 experts and the alltoall trades their positions' tokens), and
    under r3 each CP rank's routers replay its positions' recorded routes (split the zig-zag way, like the tokens):
    the cp=1 log-probs, gradients of every parameter (the experts', each on its EP rank), two steps' metrics
    (router/* among them) and the weights published after them; the cp=2 x ep=2 learner's checkpoint (each EP rank's
    experts, the CP ranks' replicas of the rest) resumes those weights at its layout."""
    moe_dir = str(save_tiny_moe(tmp_path / "mixtral", "mixtral", vocab_size=VOCAB))
    batches = _with_routes(_batches(2), layers=2, experts=4, top_k=2)
    layouts = {"moe_cp2": {"cp": 2, "micro_batch_size": 8, "loss": LOSS, "model_dir": moe_dir},
               "moe_cp2_ep2_r3": {"cp": 2, "ep": 2, "micro_batch_size": 8, "loss": LOSS, "model_dir": moe_dir,
                                  "routing_replay": "r3", "save": True}}
    proc = _launch(moe_dir, batches, tmp_path, layouts, nproc=2)
    refs = {name: _reference(moe_dir, layout, batches) for name, layout in layouts.items()}
    assert 0 < refs["moe_cp2"]["metrics"][0]["router/agreement"] < 1
    results = _results(proc, tmp_path, layouts, nproc=2, timeout=600)
    for name, ranks in results.items():
        for rank in ranks:
            # (expert parallelism packs each micro-batch's rows again after evening out the EP ranks' micro-batch
            # counts, step.pad_micro_batches: another cut of the same rows)
            _assert_matches(_with_all_grads(rank, ranks), refs[name], name,
                            layout_metrics=("padding_frac", "shared_frac") if "ep2" in name else ())
            _assert_published(rank, refs[name], name)
    for rank in results["moe_cp2_ep2_r3"]:  # (the checkpoint resumed at its own layout)
        _assert_published({"published": rank["resumed_published"]}, rank, "moe_cp2_ep2_r3 resumed")
