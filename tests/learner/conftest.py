"""Fixtures of the learner tests."""
import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """World-size-1 gloo default group (the learner ranks), torn down after the module."""
    from megatron.core import parallel_state

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
