"""A run's console opens without megatron-core's known notices, shows torch's per-call deprecations once, and
hides nothing else."""
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
# tensor parallelism's advice about CUDA streams (this machine has no GPU)
warnings.warn_explicit("When using sequence parallelism it is recommended to set the environment variable "
                       "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning, "layers.py", 730,
                       module="megatron.core.tensor_parallel.layers")
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
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in loud and "CUDA_DEVICE_MAX_CONNECTIONS" not in quiet
    assert quiet.count("Apex is not installed. Falling back to Torch Norm") == 1  # the one from user.py
    assert "user.py:1" in quiet and "a new megatron notice" in quiet
    assert len(KNOWN_MEGATRON_NOTICES) == 3


PER_STEP_COLLECTIVES = """
import warnings
{silence}
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
out, x = torch.zeros(4), torch.ones(4)
for _ in range(3):  # three steps of what DeepSpeed's ZeRO calls, each after code that enters catch_warnings
    dist.all_gather_into_tensor(out, x)
    dist.reduce_scatter_tensor(x, out)
    with warnings.catch_warnings():
        pass
    warnings.warn("another notice", FutureWarning)
dist.destroy_process_group()
"""


def test_torch_s_per_call_deprecations_show_once_and_other_repeats_still_show():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def stderr(silence: str) -> str:
        proc = subprocess.run([sys.executable, "-c", "import torch\n" + PER_STEP_COLLECTIVES.format(
            silence=silence, port=port)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    loud = stderr("")
    assert loud.count("`torch.distributed.reduce_scatter_tensor` is deprecated") == 3
    quiet = stderr("from megarl.observe.quiet import silence_known_library_warnings; silence_known_library_warnings()")
    assert quiet.count("`torch.distributed.reduce_scatter_tensor` is deprecated") == 1
    assert quiet.count("`torch.distributed.all_gather_into_tensor` is deprecated") == 1
    assert quiet.count("another notice") == 3  # (the catch_warnings resets its registry too: not ours to hide)
