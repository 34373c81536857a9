"""benchmarks/lora_costs.py (docs/lora.md, its cost table): its one 2-process launch on
scale.py's tiny shape through the same code as on the real one (megatron learner steps, WeightPublisher ->
WeightReceiver over gloo, the engine's merge-and-stage), so that a change that breaks the benchmark is found in CI."""
import math

from megarl.config.schema import LoraConfig
from megarl.models.lora import adapter_spec
from tests.helpers import run_python
from tests.test_scale_benchmark import last_json


def test_the_tiny_shape_measures_lora_full_and_full_delta_side_by_side(tmp_path):
    head = last_json(run_python("benchmarks/lora_costs.py", "--tiny", "--out", str(tmp_path), timeout=240))
    arms = head["arms"]
    assert set(arms) == {"lora", "full", "full_delta"} and head["shape"] == "tiny" and head["lora_rank"] == 4
    lora, full, delta = arms["lora"], arms["full"], arms["full_delta"]
    # what each version sends through the real publisher: the adapter (fp32), the model (fp32), then bf16 deltas
    from benchmarks.scale import hf_config

    adapter = sum(math.prod(shape) for _, shape, _ in adapter_spec(hf_config("tiny"), LoraConfig(rank=4))) * 4
    assert lora["publish_bytes"] == lora["first_publish_bytes"] == adapter
    assert full["publish_bytes"] == full["first_publish_bytes"] == 4 * head["params"]
    assert delta["first_publish_bytes"] == 2 * head["params"] and 0 < delta["publish_bytes"] < 2 * head["params"]
    assert 0 < lora["trainable"] < full["trainable"] == delta["trainable"] == head["params"]
    assert lora["engine_merge_stage_s"] > 0 and "engine_merge_stage_s" not in full
    assert all(a["step_s"] > 0 and a["publish_s"] > 0 and a["peak_gb"] >= 0 for a in arms.values())
