"""A run's console opens without megatron-core's known import-time notices, and nothing else is hidden."""
import subprocess
import sys

from megarl.observe.quiet import KNOWN_MEGATRON_NOTICES

IMPORT_THE_LEARNER = """
import warnings
warnings.simplefilter("default")  # show every warning once, as a fresh interpreter would at least
{silence}
import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs
from megatron.core.transformer import TransformerConfig
TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
# The same words from anywhere else, and another warning from megatron-core, still show.
warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "user.py", 1, module="user")
warnings.warn_explicit("a new megatron notice", UserWarning, "m.py", 1, module="megatron.core.models")
"""


def run(silence: str) -> str:
    proc = subprocess.run([sys.executable, "-c", IMPORT_THE_LEARNER.format(silence=silence)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_known_megatron_notices_are_silenced_and_other_warnings_are_not():
    loud = run("")
    assert loud.count("Transformer Engine and Apex are not installed") >= 2 and "full scope is deprecated" in loud
    quiet = run("from megarl.observe.quiet import silence_known_library_warnings; silence_known_library_warnings()")
    assert "Transformer Engine and Apex" not in quiet and "full scope is deprecated" not in quiet
    assert quiet.count("Apex is not installed. Falling back to Torch Norm") == 1  # the one from user.py
    assert "user.py:1" in quiet and "a new megatron notice" in quiet
    assert len(KNOWN_MEGATRON_NOTICES) == 3
