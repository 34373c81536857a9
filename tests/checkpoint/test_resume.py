"""Deciding whether a run resumes, the save schedule, rolling back the run outputs, the config keys."""
import json

import pytest

from megarl.checkpoint import resume, storage
from megarl.checkpoint.storage import CheckpointError
from megarl.config.load import ConfigError, load_config
from tests.helpers import REPO

DEMO = REPO / "configs" / "demo.yaml"


def config(tmp_path, *overrides):
    return load_config(DEMO, [f"run.dir={tmp_path}", *overrides])


def commit_fake(root, step):
    temp = storage.prepare_temp(root, step)
    (temp / storage.MANIFEST).write_text("{}")
    return storage.commit(root, temp, step, keep=2)


def test_checkpoint_keys_default_under_the_run_dir_and_are_validated(tmp_path):
    cfg = config(tmp_path)
    assert cfg.checkpoint.dir == f"{tmp_path}/checkpoints" and cfg.run.resume == "false"
    assert config(tmp_path, "run.resume=true").run.resume.lower() == "true"  # YAML/CLI booleans arrive as text
    for override, message in (("run.resume=maybe", "run.resume: must be false, true or auto"),
                              ("checkpoint.keep=0", "checkpoint.keep: must be >= 1"),
                              ("checkpoint.every_steps=-2", "checkpoint.every_steps: must be >= 0")):
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, override)


def test_which_checkpoint_a_run_resumes_from(tmp_path):
    assert resume.find_checkpoint(config(tmp_path, "run.resume=auto")) is None
    with pytest.raises(CheckpointError, match="run.resume=true but checkpoint.dir .* holds no checkpoint.*"
                                              "checkpoint.every_steps=N"):
        resume.find_checkpoint(config(tmp_path, "run.resume=true"))
    latest = commit_fake(tmp_path / "checkpoints", 6)
    assert resume.find_checkpoint(config(tmp_path, "run.resume=True")) == latest
    assert resume.find_checkpoint(config(tmp_path, "run.resume=auto")) == latest
    # A fresh run that would write checkpoints must not overwrite these; one that writes none may run.
    with pytest.raises(CheckpointError, match="already holds checkpoints .*step_00000006.*run.resume=true"):
        resume.find_checkpoint(config(tmp_path, "checkpoint.every_steps=3"))
    assert resume.find_checkpoint(config(tmp_path)) is None


def test_a_process_torchrun_restarted_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    latest = commit_fake(tmp_path / "checkpoints", 3)
    assert resume.resume_mode(config(tmp_path)) == "auto"
    assert resume.find_checkpoint(config(tmp_path, "checkpoint.every_steps=3")) == latest


def test_the_export_target_is_checked_before_training(tmp_path):
    (tmp_path / "hf").mkdir()
    resume.check_export_target(config(tmp_path, f"checkpoint.export_dir={tmp_path / 'hf'}"))  # empty: fine
    (tmp_path / "hf" / "x").write_text("")
    with pytest.raises(CheckpointError, match="export_dir .* is not an empty directory"):
        resume.check_export_target(config(tmp_path, f"checkpoint.export_dir={tmp_path / 'hf'}"))


def test_schedule_saves_every_n_steps_and_after_the_last_never_at_the_start(tmp_path):
    every3 = resume.Schedule(config(tmp_path, "run.steps=10", "checkpoint.every_steps=3"), start_step=0)
    assert [s for s in range(11) if every3.due(s)] == [3, 6, 9, 10]
    resumed = resume.Schedule(config(tmp_path, "run.steps=10", "checkpoint.every_steps=3"), start_step=6)
    assert [s for s in range(6, 11) if resumed.due(s)] == [9, 10]
    past_the_end = resume.Schedule(config(tmp_path, "run.steps=4", "checkpoint.every_steps=2"), start_step=6)
    assert not past_the_end.due(4)  # run.steps below the checkpoint: nothing trained, nothing to save
    export_only = resume.Schedule(config(tmp_path, "run.steps=4", f"checkpoint.export_dir={tmp_path}/hf"), 0)
    assert [s for s in range(5) if export_only.due(s)] == [4]
    assert not any(resume.Schedule(config(tmp_path, "run.steps=4"), 0).due(s) for s in range(5))


def test_roll_back_keeps_one_history_of_metrics_and_rollouts(tmp_path):
    # The interrupted run logged steps 0..7 (trained at versions 0..7); its checkpoint is step 6.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(8)) + '{"step": 8')
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps({"trained_at_step": s}) + "\n" for s in range(8)))
    dropped = resume.roll_back_outputs(tmp_path, {"step": 6, "version": 6})
    assert dropped == {"metrics": 2 + 1, "evals": 0, "rollouts": 2}  # steps 6, 7, the cut line; rollouts of 6, 7
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(6))
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["trained_at_step"] for r in rollouts] == list(range(6))
    assert resume.roll_back_outputs(tmp_path / "nothing_here", {"step": 6, "version": 6}) == {
        "metrics": 0, "evals": 0, "rollouts": 0}


def test_a_clean_resume_redoes_no_step_and_says_none(tmp_path):
    from megarl.roles.learner_main import resume_line

    # A run that ended at its checkpoint (step 6): steps 0..5 logged, then the evaluation of version 6.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6))
                                            + json.dumps({"step": 6, "kind": "eval", "eval_version": 6}) + "\n")
    dropped = resume.roll_back_outputs(tmp_path, {"step": 6, "version": 6})
    assert dropped == {"metrics": 0, "evals": 1, "rollouts": 0}
    assert resume_line("ck/step_6", 6, 6, 0.0, dropped["metrics"]) == "megarl: resumed from ck/step_6 (step 6, version 6)"
    assert resume_line("ck", 6, 6, 1.0, 1).endswith("; restart 1, redoing 1 logged step")
    assert resume_line("ck", 6, 6, 0.0, 3).endswith("(step 6, version 6); redoing 3 logged steps")


def test_samplers_learn_what_to_resume_from_through_the_store(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    cfg = config(tmp_path, "run.resume=auto")
    position = {"0": {"cursor": 24, "above": [26]}}
    resume.announce(store, cfg, {"version": 6, "run": {"data_position": position}})
    version, retired = resume.wait_for_announcement(store, cfg, stream=0, timeout_s=5)
    assert version == 6 and (retired.cursor, retired.above) == (24, {26})
    version, retired = resume.wait_for_announcement(store, cfg, stream=1, timeout_s=5)
    assert version == 6 and len(retired) == 0  # a sampler the checkpoint did not know starts at index 0
    fresh = dist.FileStore(str(tmp_path / "fresh"), 1)
    resume.announce(fresh, config(tmp_path), None)  # a fresh start is announced too: run.dir is ready
    assert resume.wait_for_announcement(fresh, config(tmp_path), 0, timeout_s=5)[0] is None
    with pytest.raises(TimeoutError, match="did not say within 1s what the run resumes from"):
        resume.wait_for_announcement(dist.FileStore(str(tmp_path / "empty"), 1), cfg, 0, timeout_s=1)


def test_a_fresh_run_refuses_another_runs_outputs_naming_the_choices(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "timeline").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("run: {}\n")  # rewritten by every start: not an output
    resume.prepare_run_dir(config(run_dir), None, clear=True)  # nothing in it yet
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "timeline" / "sampler1.jsonl").write_text('{"kind": "decode"}\n')
    with pytest.raises(CheckpointError) as refused:
        resume.prepare_run_dir(config(run_dir), None, clear=True)
    assert str(refused.value) == (
        f"run.dir {run_dir} already holds another run's outputs (metrics.jsonl, timeline/) and this fresh run would "
        f"mix its records into them: that run saved no checkpoint in {run_dir}/checkpoints, so it cannot be "
        f"continued; choose a new run.dir, or set run.overwrite=true to delete those outputs first")
    commit_fake(run_dir / "checkpoints", 4)
    with pytest.raises(CheckpointError, match="continue that run with run.resume=true, choose a new run.dir"):
        resume.prepare_run_dir(config(run_dir), None, clear=True)
    resume.prepare_run_dir(config(run_dir), run_dir / "checkpoints" / "step_00000004", clear=True)  # resuming
    assert (run_dir / "metrics.jsonl").exists()
    resume.prepare_run_dir(config(run_dir, "run.overwrite=true"), None, clear=False)  # megarl train: check only
    assert (run_dir / "metrics.jsonl").exists()
    resume.prepare_run_dir(config(run_dir, "run.overwrite=true"), None, clear=True)  # the learner clears
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml"]  # checkpoints stay
    # torchrun restarted the run before its first checkpoint: the failed attempt's outputs are its own.
    (run_dir / "rollouts.jsonl").write_text('{"trained_at_step": 0}\n')
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    resume.prepare_run_dir(config(run_dir), None, clear=True)
    assert not (run_dir / "rollouts.jsonl").exists()
