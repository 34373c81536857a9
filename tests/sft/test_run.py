"""`megarl sft` for real: torchrun launches of the megatron learner (two pipeline stages, so two ranks write
the HF directory) and of DeepSpeed ZeRO-3 (dp=2, chat messages through a chat template written into a copy
of the embedded model), the written directory loaded by transformers and taken by `megarl train`; and
every refusal before launch, naming the key, the file and line, or the directory."""
import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from megarl.cli import main as cli_main
from tests.helpers import REPO, run_python, train_metrics

SFT = str(REPO / "configs" / "sft.yaml")
DEMO = str(REPO / "configs" / "demo.yaml")
TEMPLATE = ("{% for m in messages %}<|reserved_0|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|reserved_0|>assistant\n{% endif %}")


def reversal(n: int, seed: int, messages: bool = False) -> list[dict]:
    """Reverse 2-3 letter strings from a 6-letter alphabet: learnable in a few steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 3)))
        out.append({"messages": [{"role": "user", "content": word}, {"role": "assistant", "content": word[::-1]}]}
                   if messages else {"prompt": f"{word}<", "completion": word[::-1]})
    return out


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hf_heldout_loss(model_dir: Path, data: Path) -> float:
    """Token-mean NLL of the records under transformers' own forward of the written directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.sft.data import load_records

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = load_records(data, AutoTokenizer.from_pretrained(model_dir), 128, model_dir=model_dir).examples
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1).gather(1, ids[0, 1:, None])[:, 0]
            nll -= float((logp * torch.tensor(e.mask[1:], dtype=torch.float64)).sum())
            tokens += sum(e.mask)
    return nll / tokens


def sft(*args: str, timeout: float = 300):
    return run_python("-m", "megarl.cli", "sft", SFT, *args, timeout=timeout)


def test_megatron_two_stages_trains_writes_an_hf_directory_that_megarl_train_takes(embedded_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", reversal(256, seed=0))
    heldout = write_jsonl(tmp_path / "heldout.jsonl", reversal(32, seed=1))
    run_dir, out = tmp_path / "run", tmp_path / "model"
    proc = sft(f"model.path={embedded_model_dir}", f"sft.data={data}", f"sft.eval_data={heldout}", "sft.steps=16",
               "sft.batch_size=32", "sft.eval_every=8", f"run.dir={run_dir}", f"sft.output_dir={out}", "learner.pp=2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"megarl: sft: data {data}: 256 records (256 prompt/completion)" in proc.stdout
    assert "sft step 16/16  loss" in proc.stdout and "megarl sft: held-out loss" in proc.stdout
    assert f"megarl sft: model written to {out} (HF format)" in proc.stdout

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(17))  # 16 steps, then the final evaluation
    assert all(math.isfinite(m["loss"]) and m["num_tokens"] > 0 for m in metrics[:16]) and "loss" not in metrics[16]
    assert [m["step"] for m in metrics if "heldout_loss" in m] == [0, 8, 16]
    before, after = metrics[0]["heldout_loss"], metrics[16]["heldout_loss"]
    assert after < 0.5 * before, (before, after)  # learnable: the held-out loss more than halves
    assert sum(m["loss"] for m in metrics[-4:-1]) < 0.5 * sum(m["loss"] for m in metrics[:3])
    assert f"held-out loss {before:.4f} (before) -> {after:.4f} (after)" in proc.stdout

    # Each pipeline stage wrote its own layers: two shards and an index, plus the base's other files.
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "megarl_sft.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer_config.json"]
    assert json.loads((out / "megarl_sft.json").read_text())["heldout_loss_after"] == after
    # transformers loads it, and its forward gives the held-out loss the run measured last.
    assert hf_heldout_loss(out, heldout) == pytest.approx(after, rel=1e-4)

    rl = run_python("-m", "megarl.cli", "train", DEMO, f"model.path={out}", "run.steps=2", f"run.dir={tmp_path / 'rl'}",
                    "algo.prompts_per_step=4", "sampling.max_new_tokens=8", "observe.trackers=[]", timeout=300)
    assert rl.returncode == 0, rl.stdout[-2000:] + rl.stderr[-3000:]
    assert [m["step"] for m in train_metrics(tmp_path / "rl")] == [0, 1]


def test_deepspeed_zero3_trains_chat_messages_through_the_model_directorys_template(embedded_model_dir, tmp_path):
    model = Path(shutil.copytree(embedded_model_dir, tmp_path / "chat-model"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    data = write_jsonl(tmp_path / "chat.jsonl", reversal(160, seed=2, messages=True))
    run_dir, out = tmp_path / "run", tmp_path / "model"
    proc = sft(f"model.path={model}", f"sft.data={data}", "sft.eval_data=''", "sft.eval_fraction=0.2", "sft.steps=6", "sft.batch_size=16",
               "sft.lr=0.003", f"run.dir={run_dir}", f"sft.output_dir={out}", "learner.backend=deepspeed",
               "learner.dp=2", "learner.deepspeed.zero_stage=3", "learner.lr_warmup_steps=2", "learner.lr_decay=cosine")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "128 training records, 32 held-out records (sft.eval_fraction of sft.data)" in proc.stdout
    assert "(160 messages)" in proc.stdout and "learner.backend deepspeed, 2 learner ranks" in proc.stdout
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == 7 and metrics[6]["heldout_loss"] < metrics[0]["heldout_loss"]
    # sft.lr is the peak of learner.lr_*'s schedule, whose decay spans the 6 SFT steps (learner.lr_decay_steps=0).
    decay = [0.003 * (1 + math.cos(math.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75)]
    assert [m["lr"] for m in metrics[:6]] == pytest.approx([0.0015, 0.003, *decay])
    assert (out / "model.safetensors").is_file()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE  # the template travels with the model


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["sft", "--dry-run", SFT, *args])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


@pytest.fixture
def good(embedded_model_dir, tmp_path) -> list[str]:
    data = write_jsonl(tmp_path / "train.jsonl", reversal(20, seed=0))
    return [f"model.path={embedded_model_dir}", f"sft.data={data}", "sft.eval_data=''", f"run.dir={tmp_path / 'run'}",
            f"sft.output_dir={tmp_path / 'out'}"]


def test_a_good_config_passes_the_checks_and_prints_the_launch(capsys, good, tmp_path):
    code, out, err = cli(capsys, *good)
    assert code == 0, err
    assert "megarl: sft: 19 training records, 1 held-out records (sft.eval_fraction of sft.data); context 128" in out
    assert "would launch: torchrun --nproc-per-node=1 --max-restarts=0" in out and "-m megarl.sft.run" in out
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()  # a dry run writes nothing


REFUSALS = {
    "unknown key": (["sft.bogus=1"], "megarl: config error: unknown config key 'sft.bogus'"),
    "deepspeed with tp": (["learner.backend=deepspeed", "learner.tp=2"], "megarl: config error: learner.tp: "
                          "learner.backend=deepspeed is data parallel only"),
    "tp not dividing the heads": (["learner.tp=3"], "tensor parallel size 3 does not divide num_attention_heads=4"),
    "batch smaller than dp": (["sft.batch_size=1", "learner.dp=2"], "megarl: config error: learner.dp: every DP rank"),
    "lora": (["learner.lora.rank=8"], "megarl: config error: learner.lora.rank: megarl sft trains every weight"),
    "bad on_overlong": (["sft.on_overlong=truncate"], "megarl: config error: sft.on_overlong: must be error or skip"),
    "data not found": (["sft.data=/nonexistent.jsonl"], "megarl: config error: sft.data: file not found: /nonexistent.jsonl"),
    "bad line": (["sft.data=BAD"], "megarl: sft data: BAD:2: not valid JSON"),
    "wrong keys": (["sft.data=KEYS"], "megarl: sft data: KEYS:1: missing key 'completion'"),
    "no chat template": (["sft.data=CHAT"], "megarl: sft data: CHAT:1: model directory MODEL has no chat template "
                         "(no MODEL/chat_template.jinja and no 'chat_template' key in MODEL/tokenizer_config.json)"),
    "overlong": (["sft.max_seq_len=5"], "tokens, longer than the context of 5 (sft.max_seq_len) "
                 "(sft.on_overlong=skip skips such records)"),
    "output holds files": (["sft.output_dir=FULL"], "megarl: sft: sft.output_dir FULL already holds files"),
    "output is the base": (["sft.output_dir=MODEL"], "is model.path, the model this run starts from"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_run_is_refused_before_launch_naming_it(case, capsys, good, embedded_model_dir, tmp_path):
    args, message = REFUSALS[case]
    paths = {"BAD": write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a<", "completion": "a"}, "{oops"]),
             "KEYS": write_jsonl(tmp_path / "keys.jsonl", [{"prompt": "a<", "answer": "a"}]),
             "CHAT": write_jsonl(tmp_path / "chat.jsonl", reversal(2, 0, messages=True)),
             "FULL": tmp_path / "full", "MODEL": embedded_model_dir}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    for key, path in paths.items():
        args = [a.replace(key, str(path)) for a in args]
        message = message.replace(key, str(path))
    code, out, err = cli(capsys, *good, *args)
    assert code == 2 and "launching" not in out
    assert message in err, err
