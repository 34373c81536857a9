"""Weight publish: bucket planning, and real multi-process broadcasts with checksum verification."""
import json
from pathlib import Path

import torch

from megarl.distributed.publish import check_spec, plan_buckets
from tests.helpers import run_torchrun

WORKER = Path(__file__).parent / "publish_worker.py"


def test_buckets_hold_every_tensor_once_in_order_within_the_size_limit():
    spec = [(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 30, 5, 100, 1, 1, 60])]
    buckets = plan_buckets(spec, bucket_bytes=40 * 4)
    names = [s.name for b in buckets for s in b.slots]
    assert names == [n for n, _, _ in spec]
    for b in buckets:
        assert b.numel <= 40 or len(b.slots) == 1  # only a lone oversized tensor may exceed
        assert [s.offset for s in b.slots] == [sum(x.numel for x in b.slots[:i]) for i in range(len(b.slots))]


def test_buckets_never_mix_dtypes():
    spec = [("a", (4,), torch.float32), ("b", (4,), torch.bfloat16), ("c", (4,), torch.float32)]
    assert [[s.name for s in b.slots] for b in plan_buckets(spec, 1 << 20)] == [["a"], ["b"], ["c"]]


def test_spec_mismatch_names_the_tensor():
    expected = {"w": (torch.Size([2, 3]), torch.float32)}
    try:
        check_spec([("w", (3, 2), torch.float32)], expected)
    except ValueError as exc:
        assert "w is [3, 2]" in str(exc)
    else:
        raise AssertionError("shape mismatch accepted")


def test_every_sampler_receives_every_version_bit_exact(tmp_path):
    proc = run_torchrun(WORKER, 3, tmp_path, "ok", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = json.loads((tmp_path / "sent.json").read_text())
    assert sent["buckets"] >= 3
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["error"] is None
        assert got["received"] == sent["sent"]


def test_corrupted_bucket_is_refused_by_every_receiver(tmp_path):
    proc = run_torchrun(WORKER, 3, tmp_path, "corrupt", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["received"] == {}
        assert "checksum mismatch for version 1" in got["error"]
