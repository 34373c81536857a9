"""Prompt datasets: rows become prompts, bad rows are named by file:line or skipped and counted, and a real
run trains on a dataset whose too-long prompts are skipped (or refused) and whose reward hangs sometimes."""
import json
import random
from pathlib import Path

import pytest

from megarl.config.load import load_config
from megarl.observe.sinks import train_records
from megarl.protocols import Prompt, Task
from megarl.rollout.datasets import BadRow, DatasetTask
from megarl.rollout.rewards import is_timeout
from megarl.rollout.tasks import build_task, task_from_config
from tests.helpers import REPO, run_python

ROWS = [{"prompt": f"{a}+{b}=", "answer": a + b, "level": a % 3} for a in range(4) for b in (0, 2, 9)]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_rows_become_prompts_with_answers_as_text_and_other_fields_as_meta(tmp_path):
    task = build_task("jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", ROWS + [""])))  # a trailing blank line
    assert isinstance(task, Task) and len(task.prompts) == 12 and task.bad_rows == 0
    assert task.prompts[5] == Prompt("1+9=", "10", {"level": 1})
    assert task.reward(task.prompts[5], "10") == 1.0 and task.reward(task.prompts[5], "11") == 0.0


def test_draws_depend_on_the_rng_alone_so_a_resumed_run_redraws_the_same_prompts(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    task, again = DatasetTask(path), DatasetTask(path)
    assert task.sample_prompts(random.Random(0), 1) == again.sample_prompts(random.Random(0), 1)
    task.sample_prompts(random.Random(1), 50)  # earlier draws change nothing
    assert task.sample_prompts(random.Random(7), 5) == again.sample_prompts(random.Random(7), 5)
    drawn = task.sample_prompts(random.Random(2), 300)
    assert {p.text for p in drawn} == {r["prompt"] for r in ROWS}  # uniform: every row comes up


def test_field_names_are_configurable(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2=", "solution": "4"}])
    cfg = load_config(None, ["task.name=jsonl", f"task.path={path}", "task.prompt_field=question",
                             "task.answer_field=solution"])
    assert task_from_config(cfg.task).prompts == [Prompt("2+2=", "4", {})]


BAD_ROWS = [
    ('{"prompt": "1+1=", "answer": 2', "not valid JSON (Expecting ',' delimiter: line 1 column 31 (char 30))"),
    ('["1+1=", "2"]', "expected an object with fields 'prompt' and 'answer', got list"),
    ('{"question": "1+1=", "answer": 2}', "missing field 'prompt' (the row has ['answer', 'question']; "
                                          "the field is set by task.prompt_field)"),
    ('{"prompt": "1+1="}', "missing field 'answer' (the row has ['prompt']; the field is set by task.answer_field)"),
    ('{"prompt": "", "answer": 2}', "field 'prompt' must be a non-empty string, got str ''"),
    ('{"prompt": 11, "answer": 2}', "field 'prompt' must be a non-empty string, got int 11"),
    ('{"prompt": "1+1=", "answer": null}', "field 'answer' must be a string or a number, got NoneType None"),
    ('{"prompt": "1+1=", "answer": true}', "field 'answer' must be a string or a number, got bool True"),
    ('{"prompt": "1+1=\\ud800", "answer": 2}', "holds a lone surrogate ('\\ud800'), which is not text"),
    ('{"prompt": "1+1=", "answer": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "nested too deep to read (more levels than Python's recursion limit)"),
    ('{"prompt": "1+1=", "answer": ' + "9" * 4301 + "}",
     "not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 4301 digits; use "
     "sys.set_int_max_str_digits() to increase the limit)"),
]


@pytest.mark.parametrize("line, problem", BAD_ROWS, ids=[problem[:40] for _, problem in BAD_ROWS])
def test_a_bad_row_is_named_by_file_and_line(line, problem, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:2] + ["", line] + ROWS[2:])
    with pytest.raises(BadRow) as info:
        DatasetTask(str(path))
    assert str(info.value) == f"{path}:4: {problem} (task.on_bad_row=skip skips such rows)"


def test_bad_rows_can_be_skipped_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, ROWS[:3] + [line for line, _ in BAD_ROWS])
    path.write_bytes(path.read_bytes() + b'{"prompt": "\xff", "answer": 1}\n')
    task = DatasetTask(str(path), on_bad_row="skip")
    assert len(task.prompts) == 3 and task.bad_rows == len(BAD_ROWS) + 1
    assert task.first_bad_row.startswith(f"{path}:4: not valid JSON")
    with pytest.raises(ValueError, match=r"no usable rows \(1 bad: first .*:1: missing field 'answer'"):
        DatasetTask(str(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x"}])), on_bad_row="skip")


def test_a_csv_file_is_refused_naming_the_formats_read(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(ValueError, match=r"data.csv:1: not valid JSON \(.*\); .csv is read as JSONL: the formats read "
                                         r"are JSONL \(one JSON object per line\), .parquet and a `datasets` "
                                         r"save_to_disk directory"):
        DatasetTask(str(path))


def test_missing_files_and_readers_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset not found: .*nope.jsonl"):
        DatasetTask(str(tmp_path / "nope.jsonl"))


def test_parquet_rows_are_prompts_too(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="reading Parquet is optional and needs pyarrow")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[:3] + [{"prompt": None, "answer": 1, "level": 0}]), path)
    assert DatasetTask(str(path), on_bad_row="skip").prompts[2] == Prompt("0+9=", "9", {"level": 0})
    with pytest.raises(BadRow, match=r"d.parquet row 3: field 'prompt' must be a non-empty string, got NoneType"):
        DatasetTask(str(path))


def test_a_saved_datasets_directory_is_read_with_the_datasets_package(tmp_path):
    datasets = pytest.importorskip("datasets", reason="reading save_to_disk directories is optional")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert len(DatasetTask(str(tmp_path / "saved")).prompts) == 12


# ------------------------------------------------------------------------------------- a real run

def dataset_with_overlong_prompts(tmp_path: Path) -> Path:
    """Addition prompts, every third one far longer than the sampler's 64-token context."""
    rows = []
    for i, row in enumerate(ROWS):
        rows.append(row)
        if i % 3 == 0:
            rows.append({"prompt": "1+" * 100 + "1=", "answer": 101})
    return write_jsonl(tmp_path / "train.jsonl", rows)


def train_on(dataset: Path, model_dir: Path, run_dir: Path, *overrides: str):
    return run_python("-m", "megarl.cli", "train", str(REPO / "configs" / "demo.yaml"), f"run.dir={run_dir}",
                      f"model.path={model_dir}", "task.name=jsonl", f"task.path={dataset}", "run.steps=3",
                      "algo.prompts_per_step=4", "algo.group_size=4", "algo.max_lag=2", "sampling.max_new_tokens=8",
                      "learner.micro_batch_size=16", "observe.trackers=[]",
                      "eval.sets=[]",  # 16 prompts: too few for the demo's held-out split (tests/eval covers that)
                      *overrides, timeout=300)


def test_a_run_trains_on_dataset_prompts_skips_overlong_ones_and_survives_a_hanging_reward(
        embedded_model_dir, tmp_path):
    dataset = dataset_with_overlong_prompts(tmp_path)
    proc = train_on(dataset, embedded_model_dir, tmp_path / "run", "task.reward_fn=tests.rollout.reward_fns:hang_on_nine",
                    "task.reward_timeout_s=0.5", "task.source_field=level",  # each row's "level" is its source
                    "task.max_reward_error_frac=1")  # a third of the prompts hang: this run must survive them
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metrics = train_records([json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()])
    assert len(metrics) == 3
    assert metrics[-1]["sampler1/skipped_overlong_prompts"] > 0  # the long prompts were drawn and skipped
    rollouts = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in rollouts} <= {r["prompt"] for r in ROWS}  # only dataset prompts, none too long
    hung = [r for r in rollouts if "9" in r["prompt"]]
    # Each hung call times out; once a group's calls (each with a new reward worker's start-up, slow on a loaded
    # machine) have spent task.reward_group_budget_s, the rest fail unscored. The first call of a group always runs.
    assert hung and all(r["reward"] == 0.0 and is_timeout(r["reward_error"]) for r in hung)
    assert any("did not return within 0.5s" in r["reward_error"] for r in hung)
    assert sum(m["reward_errors"] for m in metrics) == len(hung)
    assert all(r["reward_error"] is None for r in rollouts if "9" not in r["prompt"])
    # Per source: the samples carry their row's source; each step reports every source's mean reward.
    level = {r["prompt"]: str(r["level"]) for r in ROWS}
    assert all(r["source"] == level[r["prompt"]] for r in rollouts)
    for m in metrics:
        trained = [r for r in rollouts if r["trained_at_step"] == m["step"]]
        expected = {f"reward/source/{s}": sum(r["reward"] for r in trained if r["source"] == s)
                    / sum(r["source"] == s for r in trained) for s in {r["source"] for r in trained}}
        assert {k: v for k, v in m.items() if k.startswith("reward/source/")} == pytest.approx(expected)
    assert "megarl: reward by source: 0 " in proc.stdout  # the summary, per source


def test_a_run_refuses_overlong_dataset_prompts_when_configured(embedded_model_dir, tmp_path):
    proc = train_on(dataset_with_overlong_prompts(tmp_path), embedded_model_dir, tmp_path / "run",
                    "task.skip_overlong_prompts=false")
    assert proc.returncode != 0
    assert "does not fit sampler.max_seq_len=64" in proc.stderr, proc.stderr[-3000:]


def test_a_prompt_s_source_is_its_row_s_source_field_as_text_or_none(tmp_path):
    from megarl.rollout.datasets import source_of

    rows = [{"prompt": "1+1=", "answer": 2, "data_source": "gsm8k"}, {"prompt": "2+2=", "answer": 4, "level": 3},
            {"prompt": "3+3=", "answer": 6}]
    prompts = build_task("jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", rows))).prompts
    assert [source_of(p, "data_source") for p in prompts] == ["gsm8k", "", ""]
    assert [source_of(p, "level") for p in prompts] == ["", "3", ""] and source_of(prompts[0], "") == ""
