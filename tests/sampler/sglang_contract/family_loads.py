"""megarl's publish of each model family through that family's own SGLang model class; a subprocess of
test_family_loads.py.

    SGLANG_USE_CPU_ENGINE=1 python family_loads.py MODEL_DIR [MODEL_DIR ...]   (PYTHONPATH: as check.py's)

Each MODEL_DIR holds a tiny HF model and what megarl's learner publishes for it (publish_worker.py:
publish.safetensors, publish.json). For each, SGLang's own model class for the config's architecture (its
ModelRegistry's choice: a native class, or its transformers backend where it has none) is built on CPU, every
parameter set to NaN, and the publish goes through the class's `load_weights` as
`/update_weights_from_distributed` hands it over (weight_updater.load_weights_from_distributed: one
`load_weights` call per call of the publish, `plan_update_calls`' calls of SGLangPublisher's default bucket
format). Then:
  * nothing was refused: no call raised;
  * every parameter the model has was written: no NaN is left (vocabulary padding SGLang's loaders zero-fill);
  * every tensor landed: each value of a layer's tensor is held by a parameter of that layer (a fused qkv/gate_up
    shard, a stacked expert, ...), each value of another tensor by a parameter outside the layers. A loader that
    skips a name it does not know (they do, silently) leaves that tensor's values nowhere.
SGLANG_USE_CPU_ENGINE=1 is SGLang's own CPU mode: its layers then take their CPU paths at construction (the
rotary embedding's CUDA/vLLM kernel import is skipped). Prints one JSON line
{"version", "loaded": {dir name: {class, tensors, calls, parameters}}, "refused": {dir name: error}}.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from tests.sampler.sglang_contract.sglang_env import install_stubs

install_stubs(cpu_engine=True)

import sglang  # noqa: E402  (after the stubs)
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.distributed import parallel_state  # noqa: E402
from sglang.srt.models.registry import ModelRegistry  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from megarl.distributed.sglang_publish import free_port, plan_update_calls  # noqa: E402

# Several calls per publish even at the tiny models' sizes (the learner's default is publish.bucket_mb).
BUCKET_BYTES = 16 * 1024


def start_runtime(model_dir: str) -> None:
    """SGLang's process state a TP worker has before it builds its model: its server args published with the
    worker's place (world rank 0 of one), and its process groups (gloo, one rank)."""
    args = prepare_server_args(["--model-path", model_dir, "--device", "cpu", "--skip-tokenizer-init",
                                "--disable-overlap-schedule"])
    runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0, gpu_id=0))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.init_distributed_environment(
            backend="gloo", world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
        parallel_state.initialize_model_parallel()


def layer_of(name: str) -> str | None:
    """"layers.N." of a parameter's or a tensor's name; None outside the decoder layers."""
    parts = name.split(".")
    return f"layers.{parts[parts.index('layers') + 1]}." if "layers" in parts else None


def load(model_dir: str) -> dict:
    start_runtime(model_dir)  # (published again per model: last publish wins, as SGLang rebuilds an engine)
    hf_config = AutoConfig.from_pretrained(model_dir)
    cls, _ = ModelRegistry.resolve_model_cls(hf_config.architectures)
    torch.set_default_dtype(torch.float32)
    model = cls(config=hf_config, quant_config=None)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    sent = load_file(f"{model_dir}/publish.safetensors")
    spec = [(n, tuple(s), getattr(torch, d)) for n, s, d in json.loads(Path(model_dir, "publish.json").read_text())]
    calls = plan_update_calls(spec, "flattened_bucket", BUCKET_BYTES)
    for call in calls:
        model.load_weights([(name, sent[name]) for name, _, _ in call])
    unloaded = [name for name, p in params.items() if torch.isnan(p).any()]
    assert not unloaded, f"{cls.__name__}: parameters no published tensor reached: {unloaded}"
    held: dict[tuple[str | None, torch.dtype], list[torch.Tensor]] = {}  # (layer, dtype) -> its parameters' values
    for name, p in params.items():
        held.setdefault((layer_of(name), p.dtype), []).append(p.detach().flatten())

    def landed(name: str, tensor: torch.Tensor) -> bool:
        """Every value of `tensor`, as a parameter of its layer holds it (in that parameter's dtype: SGLang keeps
        some in another than the model's, gpt-oss's sinks in bf16), is one of that layer's parameters' values."""
        return any(torch.isin(tensor.flatten().to(dtype), torch.cat(values)).all()
                   for (layer, dtype), values in held.items() if layer == layer_of(name))

    lost = [name for name, t in sent.items() if not landed(name, t)]
    assert not lost, f"{cls.__name__}: published tensors whose values no parameter holds: {lost}"
    return {"class": cls.__name__, "tensors": len(sent), "calls": len(calls), "parameters": len(params)}


def main() -> None:
    loaded, refused = {}, {}
    for model_dir in sys.argv[1:]:
        try:
            loaded[Path(model_dir).name] = load(model_dir)
        except Exception as exc:  # noqa: BLE001 - reported per family; the test names what it expects
            traceback.print_exc()
            refused[Path(model_dir).name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"version": sglang.__version__, "loaded": loaded, "refused": refused}))


if __name__ == "__main__":
    main()
