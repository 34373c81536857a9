"""benchmarks/overlong.py: its per-arm summary reads a run's training records (not its eval records) into first ->
last tenth means of reward, completion length and truncated share, and the share of samples the shaping penalised."""
import io
import json
import sys
from contextlib import redirect_stdout

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import overlong  # noqa: E402


def test_the_summary_reads_training_records_only_and_counts_what_the_shaping_penalised(tmp_path):
    rows = [{"step": i, "reward_mean": 0.1 * (i >= 10), "completion_len_mean": 20.0 - i,
             "samples/truncated": 4.0 * (i < 10), "samples/total": 8.0, "samples/overlong_penalised": 2.0}
            for i in range(20)]
    rows.insert(5, {"kind": "eval", "step": 5, "eval_version": 5})
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    s = overlong.summarize(tmp_path)
    assert s["steps"] == 20
    assert s["reward"] == (0.0, pytest.approx(0.1)) and s["completion_len"] == (19.5, 1.5)
    assert s["truncated_frac"] == (0.5, 0.0) and s["penalised_frac"] == 0.25
    out = io.StringIO()
    with redirect_stdout(out):
        overlong.report("overlong_buffer_8", ["algo.advantage.overlong_buffer=8"], s)
    assert "truncated_frac 0.500 -> 0.000  penalised 25.0%" in out.getvalue()
