"""What a person watching a run sees: one progress line per learner step, notes, and a closing summary.

On a terminal the progress line overwrites itself ("\\r"); anywhere else (logs, CI, a pipe) it is a
plain line every ceil(run.steps / 100) steps and at the last, so a log holds about 100 of them whatever the
run's length (as `megarl sft`'s). The line carries the step, reward, the run's share of trained rollouts that
hold tokens of two or more policy versions (what Pipeline RL's in-flight updates produce), the
token lag, throughput (over the last THROUGHPUT_STEPS steps) and an ETA, and -- only on steps where some rewards failed -- the share of
the batch whose reward raised. `note(text)` prints a message (a checkpoint, an export) on its own
line: on a terminal it clears the progress line first, so the message is never glued onto it, and
redraws the line below. `close()` prints the summary of a finished run: reward first -> last 10% of
steps, the multi-version shares, versions per rollout, where the outputs are and how to draw them.
`evaluated` prints one line per held-out evaluation (megarl/eval/), and a warning when a set's pass@k falls well
below its best so far (more than WELL_BELOW_SE standard errors at the set's size: megarl.observe.score_drop); the
summary then also gives each set's pass@k (a share of prompts answered correctly) and greedy mean reward, first ->
last evaluation, the best where the last is well below it, and the count of failed episodes (agents,
environments) where there were some.
"""
from __future__ import annotations

import collections
import math
import sys
import time
from pathlib import Path

from megarl.observe.score_drop import WELL_BELOW_SE, drop_in_standard_errors

WIDTH = 110  # the progress line is padded to this, so a shorter line fully covers a longer one
SOURCE_PREFIX = "reward/source/"  # the learner's per-source rewards (megarl.observe.sources.source_rewards)
SOURCES_SHOWN = 8
# The progress line's tok/s: the tokens of the last THROUGHPUT_STEPS steps over their wall time. One step's rate swings
# by 100x (a step whose batch was waiting in the queue takes milliseconds; one that waited for generation, seconds).
THROUGHPUT_STEPS = 10
# How the eval scores read on the console: pass@k is a share of prompts answered correctly (megarl.eval.score), the
# greedy score a mean reward like reward_mean: the labels say which is which.
SCORE_LABELS = {"pass@1": "pass@1 (share correct)", "greedy": "greedy reward_mean"}
# Per-step metrics whose first -> last tenth the summary gives where a run reports them: a critic's (algo.advantage
# estimator gae) and a distillation teacher's.
TRACKED = ("critic/explained_var", "critic/value_loss", "distill/teacher_kl")
# The samplers' running counts of failed episodes (each sampler sends its counts with every group).
FAILURE_COUNTS = ("env_failures", "dropped_samples", "failed_groups")


def tenth_means(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last 10% of `values` (at least one value each)."""
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class Console:
    """The lead learner's console: `update` once per step, `note` for messages, `close` at the end."""

    def __init__(self, total_steps: int, enabled: bool, run_dir: str | Path, stream=None):
        self.total, self.enabled, self.run_dir = total_steps, enabled, Path(run_dir)
        self.stream = sys.stdout if stream is None else stream
        self.tty = self.stream.isatty()
        self.every = 1 if self.tty else max(1, math.ceil(total_steps / 100))  # (a log's lines: about 100)
        self.rewards: list[float] = []
        self.entropies: list[float] = []  # the policy's mean entropy over each step's trained tokens
        self.tracked: dict[str, list[float]] = {}  # TRACKED metrics of every step that reported them, by name
        self.source_rewards: dict[str, list[float]] = {}  # reward/source/<name> of the steps whose batch held it
        self.version_counts: list[int] = []  # distinct policy versions in each trained rollout
        self.first_update: tuple[float, int] | None = None  # (time, step) of the first step seen
        self.line = ""
        self.last_step = 0
        self.evals: list[tuple[int, dict[str, float]]] = []  # (version, metrics) of every evaluation reported
        self.router: dict[str, list[float]] = {}  # MoE: router agreement metrics of every step, by name
        self.lag_masked = [0.0, 0.0]  # tokens the loss's lag bound gave no policy gradient, of all trained
        self.overlong = [0.0, 0.0, 0]  # advantage.overlong_buffer: samples penalised, penalty sum, samples trained
        self.throughput: collections.deque = collections.deque(maxlen=THROUGHPUT_STEPS)  # (tokens, seconds) per step
        self.sampler_counts: dict[str, float] = {}  # the latest running count per sampler{rank}/<name> (FAILURE_COUNTS)

    def update(self, step: int, metrics: dict[str, float], version_counts: list[int]) -> None:
        """Step `step` (1-based) is trained; `version_counts`: distinct versions of each of its rollouts."""
        now = time.monotonic()
        self.rewards.append(metrics.get("reward_mean", float("nan")))
        if "entropy/mean" in metrics:  # (loss.entropy_metric, on by default)
            self.entropies.append(metrics["entropy/mean"])
        for key in TRACKED:
            if key in metrics:
                self.tracked.setdefault(key, []).append(metrics[key])
        for key, value in metrics.items():
            if key.startswith(SOURCE_PREFIX):
                self.source_rewards.setdefault(key[len(SOURCE_PREFIX):], []).append(value)
        self.version_counts.extend(version_counts)
        self.last_step = step
        for key, value in metrics.items():
            if key.startswith("sampler") and key.split("/", 1)[-1] in FAILURE_COUNTS:
                self.sampler_counts[key] = value
            if key.startswith("router/") or key.endswith(("/router_agreement", "/router_tokens")):
                self.router.setdefault(key, []).append(value)
        if "mask/lag_frac" in metrics:  # loss.max_token_lag is set (algo.stale=mask_tokens sets it)
            tokens = metrics["mask/tokens"]
            self.lag_masked = [self.lag_masked[0] + metrics["mask/lag_frac"] * tokens, self.lag_masked[1] + tokens]
        if "samples/overlong_penalised" in metrics and version_counts:
            n = len(version_counts)
            self.overlong = [self.overlong[0] + metrics["samples/overlong_penalised"],
                             self.overlong[1] + metrics["reward/overlong_penalty_mean"] * n, self.overlong[2] + n]
        if metrics.get("step_s", 0) > 0:
            self.throughput.append((metrics.get("tokens_per_s", 0) * metrics["step_s"], metrics["step_s"]))
        if self.first_update is None:
            self.first_update = (now, step)
        if not self.enabled:
            return
        start, first = self.first_update
        eta = (f"eta {format_duration((now - start) / (step - first) * (self.total - step))}"
               if step > first else "eta --")
        line = (f"step {step}/{self.total}  reward {metrics.get('reward_mean', float('nan')):.3f}  "
                f"multi-version {self.share(2):.0%}  lag {metrics.get('lag_mean', float('nan')):.1f}/"
                f"{metrics.get('lag_max', 0):.0f}  tok/s {self._tokens_per_s(metrics)}  "
                f"stale {metrics.get('dropped/stale_groups_total', 0):.0f}{self._masked()}  {eta}")
        errors = metrics.get("reward_errors", 0)
        if errors and version_counts:
            line += f"  reward errors {errors / len(version_counts):.0%}"
        self.line = line
        if self.tty or step % self.every == 0 or step == self.total:
            self._draw(end=step == self.total)

    def earlier_evaluations(self, records: list[dict]) -> None:
        """The evaluations a resumed run made before its checkpoint (metrics.jsonl's eval records): the held-out
        warning and the summary then compare with them too. Nothing is printed."""
        self.evals = [(int(r["eval_version"]), r) for r in records] + self.evals

    def evaluated(self, version: int, steps_trained: int, metrics: dict[str, float], what: str = "") -> None:
        """One line per evaluation: each set's scores of policy `version` (megarl/eval/); `what` names a model
        evaluated outside a run (`megarl eval`) in the version's place."""
        self.evals.append((version, metrics))
        seconds = f"{metrics.get('eval_s', 0):.1f}s"
        where = f"{what} ({seconds})" if what else f"version {version} (step {steps_trained}, {seconds})"
        self.note(f"megarl: eval {where}: "
                  + "; ".join(f"{name} {_scores(metrics, name)}" for name in eval_set_names(metrics)))
        drops = self._drops()
        if drops:
            self.note(f"megarl: warning: held-out scores well below their best: {'; '.join(drops)}. A constant "
                      f"learning rate over many steps can undo what was learned: learner.lr_decay (docs/checkpoint.md)")

    def _drops(self) -> list[str]:
        """Each pass@k of the latest evaluation more than WELL_BELOW_SE standard errors below the best evaluation of
        it so far: "<set> <key> <now> (best <best> at version <v>, <n> standard errors below)"."""
        version_now, now = self.evals[-1]
        out = []
        for name in eval_set_names(now):
            prompts = int(now.get(f"eval/{name}/prompts", 0))
            for key in _score_keys(now, name):
                if not key.startswith("pass@"):  # (greedy is a mean reward, of no known range)
                    continue
                full = f"eval/{name}/{key}"
                best_version, best = max(((v, m[full]) for v, m in self.evals if full in m), key=lambda vm: vm[1])
                sigmas = drop_in_standard_errors(best, now[full], prompts)
                if sigmas > WELL_BELOW_SE:
                    out.append(f"{name} {key} {now[full]:.3f} (best {best:.3f} at version {best_version}, "
                               f"{sigmas:.1f} standard errors of {prompts} prompts below)")
        return out

    def note(self, text: str) -> None:
        """A message on its own line; on a terminal the progress line is cleared first and redrawn after."""
        if self.tty and self.line:
            self.stream.write("\r" + " " * WIDTH + "\r")
        self.stream.write(text + "\n")
        if self.tty and self.line and self.last_step != self.total:
            self._draw(end=False)
        self.stream.flush()

    def share(self, min_versions: int) -> float:
        """Share of the rollouts trained so far that hold tokens of at least `min_versions` versions."""
        if not self.version_counts:
            return 0.0
        return sum(n >= min_versions for n in self.version_counts) / len(self.version_counts)

    def summary(self) -> str:
        first, last = tenth_means(self.rewards)
        n = len(self.version_counts)
        evals = []
        if self.evals:
            (v0, m0), (v1, m1) = self.evals[0], self.evals[-1]
            for name in eval_set_names(m1):
                changes = ", ".join(f"{SCORE_LABELS.get(key, key)} {m0.get(f'eval/{name}/{key}', float('nan')):.3f} -> "
                                    f"{m1[f'eval/{name}/{key}']:.3f}" for key in _score_keys(m1, name))
                evals.append(f"megarl: eval {name}: {changes} (version {v0} -> {v1})")
            evals += [f"megarl: warning: eval {drop}" for drop in self._drops()]
            evals.append(f"megarl:            python benchmarks/plot_eval.py {self.run_dir}   (eval curves vs step and time)")
        return "\n".join([
            f"megarl: done, {len(self.rewards)} steps. reward {first:.3f} -> {last:.3f} "
            f"(mean of the first -> last 10% of steps)",
            f"megarl: {n} rollouts trained; {self.share(2):.1%} hold tokens of >= 2 policy versions, "
            f"{self.share(3):.1%} of >= 3; {sum(self.version_counts) / max(1, n):.2f} versions per rollout",
            *self._source_summary(),
            *self._entropy_summary(),
            *self._critic_summary(),
            *self._stale_summary(),
            *self._overlong_summary(),
            *self._router_summary(),
            *self._failure_summary(),
            f"megarl: outputs in {self.run_dir}/ (metrics.jsonl, rollouts.jsonl, tensorboard/, timeline/)",
            f"megarl: draw them: python benchmarks/plot_rollouts.py {self.run_dir}   (rollouts coloured by version)",
            f"megarl:            python benchmarks/plot_timeline.py {self.run_dir}   (generated tokens/s over time)",
            *evals,
        ])

    def _tokens_per_s(self, metrics: dict[str, float]) -> str:
        """Trained tokens per second over the last THROUGHPUT_STEPS steps (the step's own rate without step_s)."""
        seconds = sum(s for _, s in self.throughput)
        if not seconds:
            return f"{metrics.get('tokens_per_s', 0):.0f}"
        return f"{sum(t for t, _ in self.throughput) / seconds:.0f} ({len(self.throughput)}-step mean)"

    def _masked(self) -> str:
        """With a lag bound: the share of trained tokens it masked so far (no policy gradient), for the progress line."""
        masked, total = self.lag_masked
        return f" (masked {masked / total:.1%})" if total else ""

    def _stale_summary(self) -> list[str]:
        masked, total = self.lag_masked
        if not total:
            return []
        return [f"megarl: {masked:.0f} tokens older than loss.max_token_lag given no policy gradient ({masked / total:.1%} "
                f"of the trained tokens; algo.stale=mask_tokens sets the bound to algo.max_lag)"]

    def _source_summary(self) -> list[str]:
        """Datasets with a source column (task.source_field): each source's reward, first -> last tenth of the steps
        whose batch held it; the first SOURCES_SHOWN sources by name, the rest counted."""
        if not self.source_rewards:
            return []
        names = sorted(self.source_rewards)
        shown = ", ".join("{} {:.3f} -> {:.3f}".format(name, *tenth_means(self.source_rewards[name]))
                          for name in names[:SOURCES_SHOWN])
        more = f" (+{len(names) - SOURCES_SHOWN} more in metrics.jsonl)" if len(names) > SOURCES_SHOWN else ""
        return [f"megarl: reward by source: {shown}{more} (first -> last 10% of the steps holding the source)"]

    def _entropy_summary(self) -> list[str]:
        if not self.entropies:
            return []
        first, last = tenth_means(self.entropies)
        return [f"megarl: policy entropy {first:.3f} -> {last:.3f} nats per trained token (first -> last 10% of steps)"]

    def _critic_summary(self) -> list[str]:
        """The critic's explained variance and value loss (GAE runs) and the student's KL from a distillation
        teacher, first -> last tenth of the steps that reported them."""
        def change(key: str) -> str:
            return "{:.3f} -> {:.3f}".format(*tenth_means(self.tracked[key]))

        lines = []
        if "critic/explained_var" in self.tracked or "critic/value_loss" in self.tracked:
            parts = [f"explained variance {change('critic/explained_var')}" if "critic/explained_var" in self.tracked
                     else "", f"value loss {change('critic/value_loss')}" if "critic/value_loss" in self.tracked else ""]
            lines.append(f"megarl: critic {', '.join(p for p in parts if p)} (first -> last 10% of steps)")
        if "distill/teacher_kl" in self.tracked:
            lines.append(f"megarl: KL from the teacher {change('distill/teacher_kl')} nats per trained token "
                         f"(log pi - log pi_teacher of the sampled tokens; first -> last 10% of steps)")
        return lines

    def _overlong_summary(self) -> list[str]:
        penalised, penalty, samples = self.overlong
        if not samples:
            return []
        return [f"megarl: {penalised:.0f} of {samples} trained samples came within algo.advantage.overlong_buffer of "
                f"their length limit and lost reward for it (mean penalty {penalty / samples:.3f} per sample; the "
                f"rewards above are the task's)"]

    def _router_summary(self) -> list[str]:
        """MoE runs: how often the learner's router chose the sampler's experts (mean over steps)."""
        if "router/agreement" not in self.router:
            return []
        mean = {k: sum(v) / len(v) for k, v in self.router.items()}
        tokens = {"" if k == "router/tokens" else k.split("/")[0] + "/": sum(v) for k, v in self.router.items()
                  if k == "router/tokens" or k.endswith("/router_tokens")}  # the trained tokens: "" overall, "lag0/"...

        def over(scope: str) -> str:
            return f" over {tokens[scope]:.0f} tokens" if scope in tokens else ""

        by_lag = ", ".join(f"{k.split('/')[0]} {v:.1%}{over(k.split('/')[0] + '/')}" for k, v in sorted(mean.items())
                           if k.endswith("/router_agreement"))
        return [f"megarl: router agreement sampler vs learner {mean['router/agreement']:.1%} of routing decisions"
                f"{over('')} ({by_lag}); {mean.get('router/token_diff_frac', 0.0):.1%} of trained tokens routed "
                f"differently in some layer (with routing replay: what the learner's router would have chosen)"]

    def _failure_summary(self) -> list[str]:
        """Episodes that failed (environment steps, agents): scored 0 and trained, or -- with no model turn, so nothing
        to train -- dropped on the sampler; a group left with no sample is replaced by a new one."""
        total = {name: sum(v for k, v in self.sampler_counts.items() if k.endswith("/" + name)) for name in FAILURE_COUNTS}
        if not any(total.values()):
            return []
        return [f"megarl: {total['env_failures']:.0f} episodes failed (environment or agent errors, scored 0); "
                f"{total['dropped_samples']:.0f} episodes without a model turn dropped before sending, "
                f"{total['failed_groups']:.0f} groups left empty and replaced (sampler{{rank}}/... in metrics.jsonl)"]

    def close(self) -> None:
        """The summary, once the run reached its last step (a failed run ends with its error instead)."""
        if self.enabled and self.rewards and self.last_step == self.total:
            self.note(self.summary())

    def _draw(self, end: bool) -> None:
        if self.tty:
            self.stream.write("\r" + self.line.ljust(WIDTH) + ("\n" if end else ""))
        else:
            self.stream.write(self.line + "\n")
        self.stream.flush()


def eval_set_names(metrics: dict[str, float]) -> list[str]:
    """The sets an eval record scores, in order (its keys are eval/<set>/<metric>)."""
    return list(dict.fromkeys(key.split("/")[1] for key in metrics if key.count("/") == 2 and key.startswith("eval/")))


def _score_keys(metrics: dict[str, float], name: str) -> list[str]:
    prefix = f"eval/{name}/"
    return [key[len(prefix):] for key in metrics if key.startswith(prefix) and key[len(prefix):].startswith("pass@")] + \
        [key for key in ("greedy",) if prefix + key in metrics]


def _scores(metrics: dict[str, float], name: str) -> str:
    p = f"eval/{name}/"
    parts = [f"{SCORE_LABELS.get(key, key)} {metrics[p + key]:.3f}" for key in ["reward_mean", *_score_keys(metrics, name)]
             if p + key in metrics]
    parts.append(f"len {metrics.get(p + 'completion_len_mean', 0):.1f}")
    parts.append(f"truncated {metrics.get(p + 'truncated_frac', 0):.0%}")
    for key in ("reward_errors", "skipped_overlong"):
        if metrics.get(p + key):
            parts.append(f"{key.replace('_', ' ')} {metrics[p + key]:.0f}")
    return " ".join(parts)
