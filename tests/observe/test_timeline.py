"""The timeline recorder: spans and decode slices round-trip through the run directory."""
from megarl.observe.timeline import Timeline, load_startup, load_timeline


def test_spans_and_token_slices_round_trip(tmp_path):
    learner = Timeline(tmp_path, "learner0")
    learner.span("train", 10.0, 10.5)
    learner.close()
    sampler = Timeline(tmp_path, "sampler1", slice_s=1.0)
    # engine steps (start, end, tokens); an idle gap between 1.5 and 5.0
    for start, end, n in [(0.0, 0.4, 5), (0.4, 0.9, 5), (0.9, 1.2, 5), (1.2, 1.5, 7), (5.0, 5.1, 1)]:
        sampler.tokens(n, start, end)
    sampler.close()
    events = load_timeline(tmp_path)
    assert events["learner0"] == [{"kind": "train", "start": 10.0, "end": 10.5}]
    slices = [(s["start"], s["end"], s["tokens"]) for s in events["sampler1"]]
    # A slice closes once it covers slice_s, or where work stopped before a gap; nothing is lost.
    assert slices == [(0.0, 1.2, 15), (1.2, 1.5, 7), (5.0, 5.1, 1)]


def test_startup_spans_are_kept_apart_from_the_run_spans(tmp_path):
    learner = Timeline(tmp_path, "learner0")
    learner.startup([("python, imports", 1.0, 3.0), ("model build", 3.0, 7.5)])
    learner.span("wait", 8.0, 9.0)
    learner.close()
    # Readers of the run's spans (busy fractions, the plots' time origin) never see the start-up.
    assert load_timeline(tmp_path)["learner0"] == [{"kind": "wait", "start": 8.0, "end": 9.0}]
    assert load_startup(tmp_path)["learner0"] == [{"kind": "startup:python, imports", "start": 1.0, "end": 3.0},
                                                  {"kind": "startup:model build", "start": 3.0, "end": 7.5}]
