"""Checkpoints: the learner's state saved and resumed exactly, and exported as an HF model.

    position.py       which prompt groups each sampler stream has retired (the data position; pure)
    storage.py        checkpoint directories: temp dir, atomic commit, `latest` pointer, retention
    learner_state.py  model / optimizer / RNG shards (megatron dist-checkpointing) + the run manifest
    export.py         a checkpoint -> an HF-format directory (no process group needed)
    trust.py          what a checkpoint must be before it is loaded (no planted pickle runs)

docs/checkpoint.md describes the format, the atomicity and resume guarantees, and resharding.
Importing this package is cheap (no megatron, no torch): the sampler uses position.py.
"""
