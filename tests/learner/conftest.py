"""Fixtures of the learner tests."""
import sys

import pytest
import torch.distributed as dist


def destroy_world() -> None:
    """Tear the default group down through DeepSpeed when it has seen it: DeepSpeed caches the world and data
    parallel groups (deepspeed.utils.groups) and would hand a later module's learner the destroyed group ("Group
    ... is not registered"); its destroy_process_group releases them."""
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.cdb is not None:
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """World-size-1 gloo default group (the learner ranks), torn down after the module."""
    from megatron.core import parallel_state

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    destroy_world()
