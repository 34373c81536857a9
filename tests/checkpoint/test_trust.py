"""Loading a checkpoint never runs code planted in it (megarl/checkpoint/trust.py): a pickle in `.metadata`
is refused by the export and by the learner's load before anything unpickles it, and so is a checkpoint
someone else could have changed."""
import os
import pickle

import pytest
import torch

from megarl.checkpoint import learner_state
from megarl.checkpoint.export import export_hf
from megarl.checkpoint.storage import MANIFEST, CheckpointError
from megarl.checkpoint.trust import check_trusted, read_dcp_metadata


class _Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def planted(tmp_path):
    """A checkpoint directory whose DCP `.metadata` runs `touch MARKER` when unpickled."""
    checkpoint, marker = tmp_path / "step_00000001", tmp_path / "MARKER"
    checkpoint.mkdir()
    (checkpoint / MANIFEST).write_text('{"format": 1, "version": 1, "layout": {}, "hf_config": {}}')
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    return checkpoint, marker


def test_a_pickle_in_the_metadata_is_refused_by_export_and_by_the_learners_load_and_runs_nothing(planted, tmp_path):
    checkpoint, marker = planted
    with pytest.raises(CheckpointError, match=r"\.metadata is not plain torch checkpoint metadata .*posix.system"):
        export_hf(checkpoint, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="not plain torch checkpoint metadata"):
        learner_state.load(None, checkpoint)  # refused before the learner (megatron / DeepSpeed) is touched
    assert not marker.exists()


def test_a_checkpoint_others_can_write_is_refused(tmp_path):
    checkpoint = tmp_path / "step_00000001"
    checkpoint.mkdir()
    (checkpoint / MANIFEST).write_text("{}")
    check_trusted(checkpoint)
    os.chmod(checkpoint / MANIFEST, 0o646)
    with pytest.raises(CheckpointError, match="megarl.json is writable by group or others .*chmod go-w -R"):
        check_trusted(checkpoint)


def test_torchs_own_metadata_reads_through_the_restricted_unpickler(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.ones(2), "extra": {"step": 3}}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    metadata = read_dcp_metadata(tmp_path / "dcp" / ".metadata")
    assert metadata.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    assert metadata.state_dict_metadata["w"].size == torch.Size([3, 4])


class _Reduced:
    """Pickles as `func(*args)`: a REDUCE written the way a given Python release writes one."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("protocol", [2, 4])
def test_an_enum_member_pickled_as_getattr_reads_and_any_other_getattr_is_refused(tmp_path, protocol):
    """Python 3.11.2 (Debian 12's) pickles an Enum member as getattr(cls, name), as DCP's metadata holds
    _MEM_FORMAT_ENCODING; 3.11.7 as cls(value). Both read; a getattr of anything but a member is refused unrun."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    for reduced in (_Reduced(getattr, _MEM_FORMAT_ENCODING, member.name), member):
        (tmp_path / ".metadata").write_bytes(pickle.dumps([reduced], protocol=protocol))
        assert read_dcp_metadata(tmp_path / ".metadata") == [member]
    for bad in (_Reduced(getattr, _MEM_FORMAT_ENCODING, "__class__"), _Reduced(getattr, torch.Size, "__init__")):
        (tmp_path / ".metadata").write_bytes(pickle.dumps(bad, protocol=protocol))
        with pytest.raises(CheckpointError, match="not plain torch checkpoint metadata"):
            read_dcp_metadata(tmp_path / ".metadata")
