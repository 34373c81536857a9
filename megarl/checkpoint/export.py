"""Export a checkpoint as an HF-format model directory (config.json, safetensors, tokenizer files).

Reads the checkpoint's files directly: no process group, no megatron model, whatever layout wrote
it.  Tensors are read one decoder layer at a time (a megatron key stacks all layers along its first
axis, ``decoder.layers.<name>``; a model whose layers differ, as megatron's ``moe_layer_freq`` list of
GLM-4.5 and DeepSeek-V3 makes them, has one key per layer, ``decoder.layers.<i>.<name>``), converted to
HF names by megarl.models.convert, and written in the dtype they were trained in (fp32 on CPU, bf16 on
GPU) into safetensors files of at most `max_shard_bytes` (with ``model.safetensors.index.json`` when there
is more than one), so memory holds one layer plus one output shard.  The result is what
``transformers.AutoModelForCausalLM.from_pretrained`` loads.
A LoRA checkpoint (learner.lora) exports the base with the adapter merged, and the adapter alone in PEFT
format under ``adapter/`` (adapter_config.json + adapter_model.safetensors, for peft onto the base model).
A checkpoint with a learned critic (advantage.estimator=gae) exports it under ``critic/``: an HF directory that
``transformers.AutoModelForTokenClassification.from_pretrained`` loads (one label: the value per token).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import torch

from megarl.checkpoint.learner_state import HF_META_DIR, quiet_dcp, read_manifest
from megarl.checkpoint.storage import CheckpointError, resolve
from megarl.checkpoint.trust import check_trusted, read_dcp_metadata
from megarl.models import convert, gated_delta_net, moe, mxfp4

LAYER_PREFIX = "decoder.layers."
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's export: the PEFT adapter directory inside the merged model's
# megatron's local layer spec saves its two norms under TransformerEngine's names (its
# sharded_state_dict_keys_map), so local- and TE-spec checkpoints are interchangeable.
_SAVED_AS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


_NUMBERED = re.compile(r"(\d+)\.(.+)")  # a per-layer key under LAYER_PREFIX: "<global layer>.<name>"


def layer_key_names(keys) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """The decoder layers' checkpoint keys by their names relative to a layer: (stacked: name -> key whose first
    axis is the layer, numbered: layer -> name -> key of that layer's whole tensor). megatron writes a layer's
    tensors under its global index when the layers are not all alike (TransformerBlock.sharded_state_dict's
    non_homogeneous_layers: a moe_layer_freq list, as the sigmoid-routed MoE families' first dense layers take, or
    a hybrid's two kinds of layer)."""
    stacked: dict[str, str] = {}
    numbered: dict[int, dict[str, str]] = {}
    for key in keys:
        if not key.startswith(LAYER_PREFIX):
            continue
        match = _NUMBERED.fullmatch(key[len(LAYER_PREFIX):])
        if match is None:
            stacked[key[len(LAYER_PREFIX):]] = key
        else:
            numbered.setdefault(int(match.group(1)), {})[match.group(2)] = key
    return stacked, numbered


def _model_keys(metadata) -> dict[str, torch.Size]:
    """Checkpoint key -> global shape of every model tensor (not optimizer state, not RNG / extra state)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: md.size for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and not k.startswith("optimizer.")}


class _LayerSlice(torch.Tensor):
    """A read request for row `layer` of a stacked [L, ...] checkpoint tensor, in torch DCP's
    checkpointable-tensor protocol (how DTensor tells DCP which chunk of a global tensor it holds)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, layer: int, global_shape: torch.Size):
        return torch.Tensor._make_wrapper_subclass(cls, global_shape, dtype=data.dtype)

    def __init__(self, data: torch.Tensor, layer: int, global_shape: torch.Size):
        self.chunk, self.offsets = data, torch.Size((layer,) + (0,) * (len(global_shape) - 1))

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.chunk.size())]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.chunk

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} is a read request, not a tensor to compute with ({func})")


def _read(checkpoint: Path, key: str, shape: torch.Size, dtype: torch.dtype, layer: int | None = None) -> torch.Tensor:
    """The whole tensor `key`, or only its row [layer] along the stacked layer axis."""
    import torch.distributed.checkpoint as dcp

    if layer is None:
        target = request = torch.empty(shape, dtype=dtype)
    else:
        target = torch.empty((1, *shape[1:]), dtype=dtype)
        request = _LayerSlice(target, layer, shape)
    with quiet_dcp():
        dcp.load({key: request}, checkpoint_id=checkpoint, no_dist=True)
    return target if layer is None else target[0]


def hf_tensors(checkpoint: str | Path, adapter_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's weights as (HF name, tensor), in save_pretrained order, one layer at a time. A LoRA
    checkpoint (learner.lora) gives the base with its adapter merged, or with `adapter_only` the adapter alone
    under HF adapter names (megarl.models.lora)."""
    from megarl.learner import lora as lora_layers

    checkpoint = resolve(checkpoint)
    check_trusted(checkpoint)  # before any pickle in it is read: DCP .metadata, DeepSpeed's .pt files
    manifest = read_manifest(checkpoint)
    hf_config = manifest["hf_config"]
    lora = manifest["layout"].get("lora")
    if adapter_only and lora is None:
        raise CheckpointError(f"{checkpoint} holds no LoRA adapter (it was not saved with learner.lora)")
    if manifest["layout"].get("backend") == "deepspeed":  # DeepSpeed's ZeRO files, HF-named (peft-named: LoRA)
        from megarl.learner.deepspeed import checkpoint_hf_tensors

        yield from checkpoint_hf_tensors(checkpoint, hf_config, lora, adapter_only)
        return
    metadata = read_dcp_metadata(checkpoint / ".metadata")
    keys = _model_keys(metadata)
    dtype = metadata.state_dict_metadata["embedding.word_embeddings.weight"].properties.dtype
    stacked, numbered = layer_key_names(keys)
    whole = {k for k in keys if not k.startswith(LAYER_PREFIX)}
    expected = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not hf_config.get("tie_word_embeddings", False):
        expected.add("output_layer.weight")
    if whole != expected:
        raise CheckpointError(f"{checkpoint}: unexpected model tensors {sorted(whole ^ expected)}")

    def read(key, layer=None):
        return _read(checkpoint, key, keys[key], dtype, layer)

    def layer_tensors(i: int, lora_only: bool = False) -> dict[str, torch.Tensor]:
        """Layer i's tensors under megatron's names relative to the layer (a LoRA adapter's alone: lora_only)."""
        out = {name: read(key, layer=i) for name, key in stacked.items() if not lora_only or ".lora." in name}
        out.update({name: read(key) for name, key in numbered.get(i, {}).items()
                    if not lora_only or ".lora." in name})
        return out

    if adapter_only:
        for i in range(hf_config["num_hidden_layers"]):
            layer = layer_tensors(i, lora_only=True)
            yield from lora_layers.hf_adapter(lora_layers.checkpoint_adapters(layer), i, hf_config,
                                              lora["target_modules"]).items()
        return
    yield "model.embed_tokens.weight", read("embedding.word_embeddings.weight")
    for i in range(hf_config["num_hidden_layers"]):
        layer = {_SAVED_AS.get(name, name): t for name, t in layer_tensors(i).items()}
        layer = gated_delta_net.join_checkpoint_parts(layer)  # (its fused tensors are saved in parts)
        if lora is not None:
            layer = lora_layers.merge_layer(layer, lora["alpha"] / lora["rank"])
        layer = moe.unstack_checkpoint_experts(layer)  # (MoE layers; a dense layer is unchanged)
        yield from convert.mcore_layer_to_hf(layer, i, hf_config).items()
    yield "model.norm.weight", read("decoder.final_layernorm.weight")
    if "output_layer.weight" in expected:
        yield "lm_head.weight", read("output_layer.weight")


def _default_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class _ShardWriter:
    """Greedy safetensors shards of at most `max_bytes` (a larger tensor gets a shard of its own),
    named the HF way once the count is known."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max_bytes:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f"part-{len(self.written):05d}.safetensors"
        save_file(self.current, str(path), metadata={"format": "pt"})
        os.chmod(path, _default_file_mode())  # safetensors creates 0600 (a private temp file it renames)
        self.written.append((path, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def close(self) -> None:
        """Write the last shard; name them model.safetensors, or model-0000i-of-0000n.safetensors
        plus model.safetensors.index.json."""
        self._flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.directory / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# Files of the policy's directory that describe the policy, not its tokenizer: not copied to the critic's export
# (its config is its own; a generation config or megarl's build / warm-start records would describe the policy).
_NOT_THE_CRITICS = ("config.json", "generation_config.json", "megarl_embedded.json", "megarl_sft.json")


def _export_critic(checkpoint: Path, out: Path) -> None:
    """A checkpoint with a learned critic (advantage.estimator=gae) exports it under `out`/critic/: the value
    model as the checkpoint holds it (transformers' token-classification class with one label: config.json +
    model.safetensors, megarl.learner.critic) plus the policy's tokenizer files (the critic reads its token ids)."""
    from megarl.learner.critic import CHECKPOINT_DIR

    source = checkpoint / CHECKPOINT_DIR
    if not source.is_dir():
        return
    (out / CHECKPOINT_DIR).mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(source / name, out / CHECKPOINT_DIR / name)
    for path in sorted((checkpoint / HF_META_DIR).iterdir()):
        if path.name not in _NOT_THE_CRITICS:
            shutil.copyfile(path, out / CHECKPOINT_DIR / path.name)


def export_hf(checkpoint: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write the checkpoint (a step dir, or a checkpoint root: its `latest`) as an HF model directory.

    `out_dir` must not exist or be empty; it appears complete or not at all (written next to it, then
    renamed).  Returns `out_dir`.
    """
    checkpoint, out_dir = resolve(checkpoint), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"export target {out_dir} exists and is not an empty directory")
    temp = out_dir.parent / f".tmp-{out_dir.name}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        shards = _ShardWriter(temp, max_shard_bytes)
        dtype = None
        for name, tensor in hf_tensors(checkpoint):
            shards.add(name, tensor)
            dtype = tensor.dtype
        shards.close()
        meta = checkpoint / HF_META_DIR
        for path in sorted(meta.iterdir()):
            if path.name != "config.json":
                shutil.copyfile(path, temp / path.name)
        config = json.loads((meta / "config.json").read_text())
        if mxfp4.is_mxfp4(config):  # (its weights were dequantized on load: what is written is float)
            del config["quantization_config"]
        # The dtype the weights are stored in (transformers >= 5 writes "dtype", older "torch_dtype").
        config["dtype" if "dtype" in config else "torch_dtype"] = str(dtype).removeprefix("torch.")
        (temp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        lora = read_manifest(checkpoint)["layout"].get("lora")
        if lora is not None:  # the merged model above, and the adapter alone for peft on the base model
            from megarl.config.schema import LoraConfig
            from megarl.models.lora import save_peft

            save_peft(temp / ADAPTER_DIR, dict(hf_tensors(checkpoint, adapter_only=True)), LoraConfig(**lora),
                      read_manifest(checkpoint)["model_dir"])
        _export_critic(checkpoint, temp)
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(temp, out_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out_dir
