"""The scores of one evaluation: pure functions from per-sample records to per-set metrics.

`pass_at_k(n, c, k)` is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1): with n samples of a prompt of which c are correct, the probability that at
least one of k samples drawn without replacement from those n is correct, 1 - C(n-c, k) / C(n, k).
It is computed as the running product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms a
binomial coefficient (those overflow a float past n ~ 1000) and stays within a few ulps of the exact
rational value.

`score_set(records, k)` turns the records of one set (megarl/eval/run.py writes them: one per sample,
sampled or greedy) into the metrics every evaluation reports per set.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

CORRECT = 1.0  # a sample is correct (for pass@k) when its reward reaches this: exact match is 0 or 1


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: n samples, c of them correct, k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def score_set(records: Iterable[dict], k: int) -> dict[str, float]:
    """Per-set metrics from the set's sample records (keys: prompt_index, greedy, reward, reward_error,
    tokens, finish_reason; an episode's also turns): mean reward and pass@1 / pass@k over the sampled
    ones (a prompt's pass@k averaged over prompts), the greedy samples' mean reward, the mean completion
    length, the share truncated by length, the count of failed rewards (scored 0) and, for episodes, the
    mean model turns."""
    sampled: dict[int, list[dict]] = defaultdict(list)
    greedy: list[dict] = []
    every = []
    for r in records:
        every.append(r)
        (greedy.append(r) if r["greedy"] else sampled[r["prompt_index"]].append(r))
    out: dict[str, float] = {"prompts": float(len(sampled) or len(greedy))}
    if sampled:
        rewards = [r["reward"] for rs in sampled.values() for r in rs]
        out["reward_mean"] = sum(rewards) / len(rewards)
        for kk in sorted({1, k}):
            values = [pass_at_k(len(rs), sum(r["reward"] >= CORRECT for r in rs), kk) for rs in sampled.values()]
            out[f"pass@{kk}"] = sum(values) / len(values)
    if greedy:
        out["greedy"] = sum(r["reward"] for r in greedy) / len(greedy)
    if every:
        out["completion_len_mean"] = sum(r["tokens"] for r in every) / len(every)
        out["truncated_frac"] = sum(r["finish_reason"] == "length" for r in every) / len(every)
        out["reward_errors"] = float(sum(r["reward_error"] is not None for r in every))
    if every and "turns" in every[0]:  # a multi-turn set's episodes
        out["turns_mean"] = sum(r["turns"] for r in every) / len(every)
    return out
