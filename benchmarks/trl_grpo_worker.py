"""TRL's GRPOTrainer on the demo task: what benchmarks/vs_trl.py runs inside the TRL environment (benchmarks/trl_env.py).

    ENV/bin/python benchmarks/trl_grpo_worker.py SPEC.json

SPEC (written by vs_trl.py): {"model_dir", "prompts": [{"prompt", "answer"}...], "grpo_config": {GRPOConfig
kwargs}, "threads", "out": per-step JSONL path, "launch_time": time.time() when vs_trl.py started this process}.
The reward is megarl's own `CountTask.reward` (megarl's tree is put on sys.path; the task module imports
nothing the TRL environment lacks), so both sides score completions with the same
code. One JSON object per optimizer step goes to `out`: step, time (time.time() at the step's log), reward
(TRL's batch mean), completion_tokens (the batch's generated tokens), generate_s (seconds in TRL's `_generate`
since the previous step's log: its HF generate over the batch), and once, kind "startup", the seconds of each
start-up part.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    marks = {"process": spec["launch_time"], "started": time.time()}
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.protocols import Prompt
    from megarl.rollout.tasks import CountTask

    marks["imported"] = time.time()
    torch.set_num_threads(spec["threads"])
    out = open(spec["out"], "w")

    def reward(prompts, completions, answer, **_):
        task = CountTask()
        return [task.reward(Prompt(text=p, answer=a), c) for p, c, a in zip(prompts, completions, answer)]

    generating = {"s": 0.0}  # seconds in `_generate` since the last step's log

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer timing its generation (`_generate`: HF generate over one batch of prompts)."""

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                generating["s"] += time.perf_counter() - start

    class StepLog(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_begin"] = time.time()
            out.write(json.dumps({"kind": "startup", **{k: round(v - marks["process"], 3) for k, v in marks.items()
                                                         if k != "process"}}) + "\n")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                batch = args.generation_batch_size
                out.write(json.dumps({"step": state.global_step, "time": time.time(), "reward": logs["reward"],
                                      "completion_tokens": logs["completions/mean_length"] * batch,
                                      "generate_s": round(generating["s"], 4)}) + "\n")
                generating["s"] = 0.0
                out.flush()

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    marks["model_loaded"] = time.time()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[reward], args=GRPOConfig(**spec["grpo_config"]),
                               train_dataset=Dataset.from_list(spec["prompts"]), processing_class=tokenizer,
                               callbacks=[StepLog()])
    marks["trainer_built"] = time.time()
    trainer.train()
    out.close()


if __name__ == "__main__":
    main(sys.argv[1])
