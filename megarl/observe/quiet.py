"""The library warnings a megarl run silences: known, harmless notices megatron-core prints at import.

On a machine without Transformer Engine and Apex (every CPU machine, and GPU machines that run the
local layer spec) megatron-core 0.16 warns once per module that it falls back to its torch
implementations, plus one deprecation note about CUDA-graph scopes; 14 lines before the first step,
none of which a user can or should act on. Each filter matches one exact message from megatron-core
modules only, so any other warning -- and every error -- still reaches the console.
"""
from __future__ import annotations

import warnings

# (message regex, as megatron-core 0.16.1 words it) -- a changed wording shows again, which is the point.
KNOWN_MEGATRON_NOTICES = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"full scope is deprecated\. Use empty cuda_graph_scope to capture the whole layer\.",
)


def silence_known_library_warnings() -> None:
    """Install the filters; call before megatron-core is imported (warnings fire at import)."""
    for message in KNOWN_MEGATRON_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.core(\.|$)")
