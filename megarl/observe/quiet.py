"""The library warnings a megarl run quiets: known notices that say nothing a user can act on, or say it once
per step.

  * megatron-core 0.16 warns at import, once per module, that it falls back to its torch implementations on a
    machine without Transformer Engine and Apex (every CPU machine, and GPU machines that run the local layer
    spec), plus one deprecation note about CUDA-graph scopes: silenced.
  * megatron-core advises CUDA_DEVICE_MAX_CONNECTIONS=1 for tensor/sequence parallelism: advice about CUDA
    streams, silenced where there is no GPU (on a GPU it still shows).
  * torch 2.13 deprecates the collectives DeepSpeed's ZeRO calls every step (`reduce_scatter_tensor`,
    `all_gather_into_tensor`); every `warnings.catch_warnings` anywhere resets the registries behind the "default"
    and "once" filters, so it repeated through a run (half of a DeepSpeed run's log): shown once per process by
    a `showwarning` that remembers it.
Each filter matches one exact message from one library, so any other warning -- and every error -- still
reaches the console.
"""
from __future__ import annotations

import re
import warnings

# (message regex, as megatron-core 0.16.1 words it) -- a changed wording shows again, which is the point.
KNOWN_MEGATRON_NOTICES = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"full scope is deprecated\. Use empty cuda_graph_scope to capture the whole layer\.",
)
CUDA_ONLY_MEGATRON_ADVICE = r"When using .* it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS"
# (torch 2.13's wording)
PER_CALL_TORCH_DEPRECATIONS = r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"


def silence_known_library_warnings() -> None:
    """Install the filters; call before megatron-core is imported (warnings fire at import)."""
    import torch

    megatron = r"megatron\.core(\.|$)"
    for message in KNOWN_MEGATRON_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=megatron)
    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=CUDA_ONLY_MEGATRON_ADVICE, category=UserWarning, module=megatron)
    warnings.showwarning = _ShowOnce(warnings.showwarning, re.compile(PER_CALL_TORCH_DEPRECATIONS))


class _ShowOnce:
    """warnings.showwarning that passes a message matching `pattern` on the first time only."""

    def __init__(self, show, pattern: re.Pattern):
        self.show, self.pattern, self.shown = show, pattern, set()

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if self.pattern.match(text):
            if text in self.shown:
                return
            self.shown.add(text)
        self.show(message, category, filename, lineno, file, line)
