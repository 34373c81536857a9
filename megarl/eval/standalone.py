"""`megarl eval CONFIG [key=value ...]`: score a model directory (model.path) or a learner checkpoint with the
eval code a run uses, without training, and write the result as JSON.

The model is loaded into a built-in engine and each share of the sets (one per sampler.num_engines, as in
a run) is generated on a pinned engine with the run's seed and batch size (megarl/eval/run.py), so the
numbers equal the run's evaluation of the same weights.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from megarl.eval.run import eval_batch, eval_seed, run_share, summarise
from megarl.eval.sets import build_sets


def evaluate_model(cfg, model_dir: str | Path, version: int = 0) -> dict:
    """{"model", "version", "metrics", "records"} of every set in cfg.eval.sets on the model at `model_dir`."""
    import torch
    from transformers import AutoTokenizer

    from megarl.sampler.engine import BuiltinEngine

    torch.set_num_threads(cfg.sampler.threads)  # the sampler's: CPU kernels may sum in another order otherwise
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sets = build_sets(cfg)
    base = BuiltinEngine.from_pretrained(str(model_dir), max_running=1, max_seq_len=cfg.sampler.max_seq_len,
                                         version=version, model_impl=cfg.sampler.model_impl)
    shares = [run_share(base.pinned(max_running=eval_batch(cfg), seed=eval_seed(cfg.eval.seed, share)), tokenizer,
                        sets, cfg, share, cfg.sampler.num_engines) for share in range(cfg.sampler.num_engines)]
    return {"model": str(model_dir), "version": version,
            "metrics": summarise(shares, [s.name for s in sets], cfg.eval.k),
            "records": [r for s in shares for r in s["records"]]}


def evaluate_checkpoint(cfg, checkpoint: str | Path) -> dict:
    """The same for a learner checkpoint (a step_N directory or a checkpoint.dir: its latest), exported to a
    temporary HF directory first; the version is the checkpoint's policy version."""
    from megarl.checkpoint.export import export_hf
    from megarl.checkpoint.manifest import read_manifest
    from megarl.checkpoint.storage import resolve

    path = resolve(checkpoint)
    with tempfile.TemporaryDirectory(prefix="megarl-eval-") as tmp:
        out = export_hf(path, Path(tmp) / "model")
        result = evaluate_model(cfg, out, version=int(read_manifest(path)["version"]))
    result["model"] = str(path)
    return result


def write_result(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return out
