"""Weight publish: bucket planning, and real multi-process broadcasts with checksum verification."""
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megarl.distributed.publish import (BITMAP, PAIRS, WHOLE, WeightPublisher, apply_delta, check_spec, delta_payload,
                                       delta_size, header_key, plan_buckets, sender_share)
from tests.helpers import run_forked_ranks

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


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """One launch of 3 ranks for the ok, delta and corrupt modes, one after the other (corrupt last: its receivers
    stop at the refused bucket); each mode's files in its own directory."""
    out = tmp_path_factory.mktemp("publish")
    return run_forked_ranks(WORKER, 3, out, "ok,delta,corrupt", timeout=240, warm="torch"), out


def test_every_sampler_receives_every_version_bit_exact(three_ranks):
    """Packed buckets, lone contiguous tensors sent as they are and a lone transposed view all arrive
    bit-exact at every receiver."""
    proc, tmp_path = three_ranks[0], three_ranks[1] / "ok"
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = json.loads((tmp_path / "sent0.json").read_text())
    assert sent["buckets"] >= 4
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["error"] is None
        assert got["received"] == sent["sent"]


def test_two_senders_each_send_a_share_and_every_sampler_receives_the_whole_model_bit_exact(tmp_path):
    """publish.senders=2: two DP replicas with the same weights each send every other bucket over their
    own group, the shares are disjoint and together the model, every receiver gets every version whole."""
    proc = run_forked_ranks(WORKER, 4, tmp_path, "senders", timeout=120, warm="torch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tmp_path = tmp_path / "senders"
    shares = [json.loads((tmp_path / f"sent{rank}.json").read_text()) for rank in (0, 1)]
    assert shares[0]["sent"] == shares[1]["sent"]  # the same weights on both replicas
    own = [set(share["own"]) for share in shares]
    assert own[0] and own[1] and not own[0] & own[1]
    assert own[0] | own[1] == set(shares[0]["sent"]["1"])
    for rank in (2, 3):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["error"] is None
        assert got["received"] == shares[0]["sent"]


def test_bf16_delta_publish_sends_only_changed_words_and_every_receiver_rebuilds_them_bit_exact(three_ranks):
    """publish.dtype=bfloat16 + publish.delta: fp32 learner and engines, bf16 on the wire. The first
    publish is whole (half the fp32 bytes); a version moving 1% of the elements sends ~3% of them (6-byte
    index/value pairs per changed bf16 word, or a bitmap); one moving every element falls back to whole
    buckets. The
    receivers patch their last words, pass the source's checksums and hold exactly the bf16-rounded
    weights."""
    proc, tmp_path = three_ranks[0], three_ranks[1] / "delta"
    assert proc.returncode == 0, proc.stderr[-3000:]
    sent = json.loads((tmp_path / "sent0.json").read_text())
    sizes = {int(v): size for v, size in sent["sizes"].items()}
    full = sizes[1]["full_bytes"]
    assert full == sum(4 * n for n in (300 * 200, 7, 64 * 64, 3 * 5, 90 * 40)) // 2  # bf16: half the fp32 bytes
    assert sizes[1]["bytes"] == full
    assert sizes[2]["bytes"] < 0.05 * full and sizes[4]["bytes"] < 0.05 * full
    assert full <= sizes[3]["bytes"] <= full + 16 * sent["buckets"]  # whole buckets, after their delta headers
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["error"] is None
        assert got["received"] == sent["sent"]


@pytest.mark.parametrize("changed, encoding", [(4, PAIRS), (100, BITMAP), (1000, WHOLE), (0, PAIRS)])
def test_a_delta_payload_is_the_smallest_encoding_and_rebuilds_the_new_words_exactly(changed, encoding):
    """1000 bf16 words: a few changed travel as index/value pairs, a tenth as a bitmap + values, all of them
    whole; NaN and -0 count as changed bit patterns."""
    old = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    new = old.clone()
    where = torch.randperm(1000, generator=torch.Generator().manual_seed(1))[:changed]
    new[where] += 1
    if changed:
        new[where[0]] = float("nan")
    got, count, payload = delta_payload(new, old)
    assert (got, count) == (encoding, changed)
    assert payload.numel() * payload.element_size() == delta_size(encoding, changed, 1000, 2)
    if encoding == WHOLE:
        assert payload is new
        return
    patched = old.clone()
    apply_delta(patched, encoding, count, payload)
    assert torch.equal(patched.view(torch.int16), new.view(torch.int16))


def test_sender_shares_are_round_robin_buckets_of_the_whole_plan():
    spec = [(f"t{i}", (10,), torch.float32) for i in range(6)]
    # 80-byte buckets hold two 40-byte tensors: buckets [t0 t1] [t2 t3] [t4 t5] -> sender 0 gets 0 and 2.
    assert [n for n, _, _ in sender_share(spec, 80, 2, 0)] == ["t0", "t1", "t4", "t5"]
    assert [n for n, _, _ in sender_share(spec, 80, 2, 1)] == ["t2", "t3"]
    assert sender_share(spec, 80, 1, 0) == spec


def test_a_version_that_does_not_match_the_first_is_refused_before_its_header():
    """Shapes, dtypes and names are fixed by the first publish; a mismatch raises a ValueError naming the
    tensor and writes no header, so receivers never wait for buckets that will not come."""
    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))  # a real (one-rank) gloo group
    publisher = WeightPublisher(group, store, bucket_mb=1, timeout_s=10, checksum=True)
    good = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    assert publisher.publish(1, good.items())["bytes"] == 15 * 4
    for bad, message in (({"w": torch.zeros(3, 4), "b": torch.zeros(3)}, r"w is \[3, 4\]"),
                         ({"w": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(3)}, "w is .*float64"),
                         ({"w": torch.zeros(4, 3)}, "b is missing"),
                         (dict(good, extra=torch.zeros(1)), "not in the first publish's spec")):
        with pytest.raises(ValueError, match=message):
            publisher.publish(2, bad.items())
    assert not store.check([header_key(2)])
    publisher.publish(2, good.items())
    assert store.check([header_key(2)])


class RecordingGroup:
    """A real one-rank gloo group that logs each broadcast it starts."""

    def __init__(self, log: list):
        self.store = dist.HashStore()
        self.group, self.log = dist.ProcessGroupGloo(self.store, 0, 1, timedelta(seconds=10)), log

    def broadcast(self, tensor, root, timeout):
        self.log.append(("send", tensor.numel()))
        return self.group.broadcast(tensor, root, timeout)


def test_tensors_stream_into_buckets_sent_as_they_fill_never_the_whole_model():
    """With the learner's spec, each bucket goes on the wire as soon as its tensors have arrived, before
    the next tensors are produced (a learner gathers or converts them meanwhile), and the source packs into
    at most IN_FLIGHT reused buffers whatever the model's size."""
    log: list = []
    rec = RecordingGroup(log)
    publisher = WeightPublisher(rec, rec.store, bucket_mb=64 * 4 / 2**20, timeout_s=10, checksum=True)
    weights = {f"w{i}": torch.full((16, 2), float(i)) for i in range(12)}  # two tensors per 64-word bucket

    def stream():
        for name, tensor in weights.items():
            log.append(("yield", name))
            yield name, tensor

    spec = [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
    assert publisher.publish(1, stream(), spec=spec)["bytes"] == 12 * 32 * 4
    assert publisher.publish(2, stream(), spec=spec)["bytes"] == 12 * 32 * 4
    first = log[:len(log) // 2]
    assert first[:3] == [("yield", "w0"), ("yield", "w1"), ("send", 64)]
    assert first.index(("send", 64)) < first.index(("yield", "w2"))  # sent before the next bucket exists
    assert [e for e in first if e[0] == "send"] == [("send", 64)] * 6
    packing = [buf for slot in publisher.ring for buf in slot.values()]
    assert len(packing) == WeightPublisher.IN_FLIGHT and all(b.numel() == 64 for b in packing)


def test_a_stream_that_breaks_its_own_spec_is_named():
    log: list = []
    rec = RecordingGroup(log)
    publisher = WeightPublisher(rec, rec.store, bucket_mb=1, timeout_s=10, checksum=False)
    spec = [("a", (2,), torch.float32), ("b", (3,), torch.float32)]
    with pytest.raises(RuntimeError, match=r"yielded b \[2\] torch.float32 where its publish spec has b \[3\]"):
        publisher.publish(1, iter([("a", torch.zeros(2)), ("b", torch.zeros(2))]), spec=spec)
    with pytest.raises(RuntimeError, match="yielded nothing where its publish spec has b"):
        publisher.publish(2, iter([("a", torch.zeros(2))]), spec=spec)
    with pytest.raises(ValueError, match="another order"):
        publisher.publish(3, iter([]), spec=spec[::-1])


def test_corrupted_bucket_is_refused_by_every_receiver(three_ranks):
    proc, tmp_path = three_ranks[0], three_ranks[1] / "corrupt"
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["received"] == {}
        assert "checksum mismatch for version 1" in got["error"]


def test_the_bucket_checksum_sees_every_flipped_byte_and_misplaced_chunk():
    """Against the bytes themselves: equal bytes give equal checksums whatever the tensor's dtype, offset
    or thread count; one changed byte anywhere (words and trailing bytes) or two swapped chunks change it."""
    from megarl.distributed.publish import CHECKSUM_CHUNK_WORDS, bucket_checksum

    g = torch.Generator().manual_seed(0)
    nbytes = 3 * CHECKSUM_CHUNK_WORDS * 8 + 8 * 5 + 6  # three whole chunks, loose words, trailing bytes
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    reference = bucket_checksum(data)
    assert bucket_checksum(data.clone().view(torch.bfloat16)) == reference  # bytes, not values
    unaligned = torch.cat([torch.zeros(2, dtype=torch.uint8), data])[2:]  # storage offset 2
    assert unaligned.storage_offset() % 8 and bucket_checksum(unaligned) == reference
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert bucket_checksum(data) == reference
    finally:
        torch.set_num_threads(threads)
    for position in [0, 7, 8 * CHECKSUM_CHUNK_WORDS, nbytes - 7, nbytes - 1,
                     *torch.randint(0, nbytes, (20,), generator=g).tolist()]:
        for flip in (1, 128):
            changed = data.clone()
            changed[position] ^= flip
            assert bucket_checksum(changed) != reference, (position, flip)
    chunk = 8 * CHECKSUM_CHUNK_WORDS
    swapped = data.clone()
    swapped[:chunk], swapped[chunk:2 * chunk] = data[chunk:2 * chunk], data[:chunk]
    assert bucket_checksum(swapped) != reference
    assert bucket_checksum(torch.zeros_like(data)) != reference
