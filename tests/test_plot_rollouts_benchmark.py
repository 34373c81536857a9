"""benchmarks/plot_rollouts.py: which tokens it draws pale (older than the run's loss.max_token_lag when trained: no
policy gradient), and that it draws a run with and without a lag bound."""
import json
import sys

import yaml

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import plot_rollouts  # noqa: E402


def _run(tmp_path, bound):
    run = tmp_path / ("bounded" if bound is not None else "plain")
    run.mkdir()
    rollouts = [{"trained_at_step": 5, "versions": [2, 3, 4, 4, 5]},
                {"trained_at_step": 5, "versions": [3, -1, -1, 4]},  # an episode: tool tokens are no version
                {"trained_at_step": 6, "versions": [6, 6]}]
    (run / "rollouts.jsonl").write_text("\n".join(map(json.dumps, rollouts)))
    if bound is not None:
        (run / "config.yaml").write_text(yaml.safe_dump({"algo": {"max_lag": bound, "loss": {"max_token_lag": bound}}}))
    return run, rollouts


def test_tokens_older_than_the_bound_when_trained_are_the_pale_ones(tmp_path):
    run, rollouts = _run(tmp_path, bound=1)
    assert plot_rollouts.lag_bound(run) == 1
    assert plot_rollouts.no_gradient(rollouts[0], 1) == [True, True, False, False, False]
    assert plot_rollouts.no_gradient(rollouts[1], 1) == [True, False, False, False]
    assert plot_rollouts.no_gradient(rollouts[2], 0) == [False, False]
    assert plot_rollouts.render(run, tmp_path / "bounded.png", at=5, steps=2).stat().st_size > 0


def test_a_run_without_a_bound_draws_nothing_pale(tmp_path):
    run, _ = _run(tmp_path, bound=None)
    assert plot_rollouts.lag_bound(run) is None
    assert plot_rollouts.render(run, tmp_path / "plain.png", at=5, steps=2).stat().st_size > 0
