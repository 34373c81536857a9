"""A learner checkpoint's manifest (``megarl.json``, docs/checkpoint.md): reading it, and whether a learner of a
given config can resume from it.

No torch: `megarl train` refuses a checkpoint the run could not load before it launches anything, in a process
that imports no torch for it; megarl.checkpoint.learner_state writes the manifest and checks it again on load.
"""
from __future__ import annotations

import json
from pathlib import Path

from megarl.checkpoint.storage import MANIFEST, CheckpointError

FORMAT = 1


def read_manifest(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r}, this megarl reads {FORMAT}")
    return manifest


def layout_of(learner_cfg) -> dict:
    """The layout a learner of this config writes into a checkpoint's manifest."""
    layout = {"tp": learner_cfg.tp, "pp": learner_cfg.pp, "dp": learner_cfg.dp}
    if learner_cfg.ep > 1:  # (absent at ep=1, so manifests written before ep was recorded read as ep=1)
        layout["ep"] = learner_cfg.ep
    if learner_cfg.backend == "deepspeed":  # DeepSpeed's own checkpoint (megarl.learner.deepspeed)
        layout.update(backend="deepspeed", zero_stage=learner_cfg.deepspeed.zero_stage)
    if learner_cfg.lora.rank > 0:  # the adapter's shape and scale: export merges and writes it with these
        lora = learner_cfg.lora
        layout["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                          "target_modules": sorted(lora.target_modules)}
    return layout


def check_resumable(path: Path, manifest: dict, learner_cfg) -> None:
    """CheckpointError unless a learner of `learner_cfg` can load this checkpoint: the backend that saved
    it, and for DeepSpeed the same learner.dp and zero_stage (its ZeRO partitions are per DP rank and
    stage; megatron's distributed checkpoint reshards to any layout). Pure: `megarl train` runs it
    before launching anything, the learner again when it loads."""
    saved, ours = manifest["layout"], layout_of(learner_cfg)
    if saved.get("lora") != ours.get("lora"):
        raise CheckpointError(f"{path} was saved with learner.lora={saved.get('lora') or 'off'}, this run has "
                              f"learner.lora={ours.get('lora') or 'off'}: resume with the adapter it was saved with "
                              f"(or `megarl export` it and start a new run from the merged HF directory)")
    if saved.get("ep", 1) != ours.get("ep", 1):
        # megatron-core gives expert-parallel parameters an Adam of their own (a ChainedOptimizer of two, whose
        # checkpoint keys and per-parameter state are numbered per optimizer) only when learner.ep > 1, and
        # numbers the experts' state by the experts a rank holds: its loader cannot map one such layout's
        # optimizer state onto another's.
        raise CheckpointError(f"{path} was saved with learner.ep={saved.get('ep', 1)}, this run has "
                              f"learner.ep={ours.get('ep', 1)}: megatron-core's optimizer state of expert-parallel "
                              f"experts loads only under the learner.ep that saved it; resume with "
                              f"learner.ep={saved.get('ep', 1)}, or `megarl export` it "
                              f"and start a new run from the HF directory")
    if "deepspeed" not in (saved.get("backend"), ours.get("backend")):
        return
    if saved.get("backend", "megatron") != ours.get("backend", "megatron"):
        raise CheckpointError(f"{path} was saved by learner.backend={saved.get('backend', 'megatron')}, this run has "
                              f"learner.backend={learner_cfg.backend}: resume with the backend that saved it")
    if saved != ours:
        keys = {"dp": "learner.dp", "zero_stage": "learner.deepspeed.zero_stage"}
        diff = {name: (saved.get(k), ours.get(k)) for k, name in keys.items() if saved.get(k) != ours.get(k)}
        raise CheckpointError(
            f"{path} holds DeepSpeed ZeRO partitions for another layout: (checkpoint, this run) = {diff}; "
            f"resume with the learner.dp and learner.deepspeed.zero_stage it was saved with "
            f"(or `megarl export` it and start a new run from the HF directory)")
