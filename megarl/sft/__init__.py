"""Supervised fine-tuning (`megarl sft CONFIG`): a warm start on a JSONL file of prompt/completion or chat
records, trained by the learner backends of `megarl train` and written as an HF model directory.

data.py: records -> token ids and loss masks (pure); run.py: the torchrun entry (every rank a learner).
docs/sft.md describes the formats, the keys (`sft.*`) and a worked SFT -> RL example.
"""
