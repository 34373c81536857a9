"""The timeline recorder: spans and decode slices round-trip through the run directory."""
from megarl.observe.timeline import Timeline, load_timeline


def test_spans_and_token_slices_round_trip(tmp_path):
    learner = Timeline(tmp_path, "learner0")
    learner.span("train", 10.0, 10.5)
    learner.close()
    sampler = Timeline(tmp_path, "sampler1", slice_s=1.0)
    for t, n in [(0.0, 5), (0.4, 5), (0.9, 5), (1.2, 7), (5.0, 1)]:
        sampler.tokens(n, now=t)
    sampler.close()
    events = load_timeline(tmp_path)
    assert events["learner0"] == [{"kind": "train", "start": 10.0, "end": 10.5}]
    slices = events["sampler1"]
    # A slice closes when a token arrives >= slice_s after it opened; tokens are never lost.
    assert [(s["start"], s["end"], s["tokens"]) for s in slices[:2]] == [(0.0, 1.2, 15), (1.2, 5.0, 7)]
    assert sum(s["tokens"] for s in slices) == 23
