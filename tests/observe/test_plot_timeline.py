"""benchmarks/plot_timeline.py as a user runs it: --help, a wrong directory, and a long run drawn whole."""
import random

from megarl.observe.timeline import Timeline
from tests.helpers import REPO, run_python

SCRIPT = str(REPO / "benchmarks" / "plot_timeline.py")


def long_run(run_dir, seconds: float = 900.0) -> None:
    """A 15-minute pipeline run: two samplers decoding in 0.05 s slices, the learner training ~0.4 s a step."""
    rng = random.Random(0)
    learner = Timeline(run_dir, "learner0")
    samplers = [Timeline(run_dir, f"sampler{r}", slice_s=0.05) for r in (1, 2)]
    t = 1000.0
    while t < 1000.0 + seconds:
        wait, train = rng.uniform(0.2, 0.6), rng.uniform(0.3, 0.5)
        learner.span("wait", t, t + wait)
        learner.span("train", t + wait, t + wait + train)
        for sampler in samplers:
            for k in range(int((wait + train) / 0.05)):
                sampler.tokens(rng.randint(20, 40), t + 0.05 * k, t + 0.05 * (k + 1))
        t += wait + train
    for timeline in (learner, *samplers):
        timeline.close()


def test_help_and_a_wrong_directory_say_what_to_give(tmp_path):
    proc = run_python(SCRIPT, "--help")
    assert proc.returncode == 0 and "--zoom-start" in proc.stdout and "RUN_DIR" in proc.stdout
    proc = run_python(SCRIPT, str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert proc.stderr == f"plot_timeline: {tmp_path / 'nope'} is not a directory (give a run's run.dir)\n"
    proc = run_python(SCRIPT, str(tmp_path))
    assert proc.returncode == 2 and f"{tmp_path} holds no timeline (expected {tmp_path}/timeline/*.jsonl" in proc.stderr


def test_a_long_run_is_drawn_in_time_bins_with_a_zoom_the_user_picks(tmp_path):
    long_run(tmp_path)
    out = tmp_path / "zoomed.png"
    proc = run_python(SCRIPT, str(tmp_path), str(out), "--zoom-start", "300", "--zoom-s", "10", timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"plot_timeline: wrote {out}\n" and out.stat().st_size > 10_000
    proc = run_python(SCRIPT, str(tmp_path), timeout=180)
    assert proc.stdout == f"plot_timeline: wrote {tmp_path / 'timeline.png'}\n"
    proc = run_python(SCRIPT, str(tmp_path), "--zoom-start", "5000", timeout=180)
    assert proc.returncode == 2 and "--zoom-start 5000s is past the end of the run (900." in proc.stderr
