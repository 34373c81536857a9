"""Store records signed with the run secret: what a client of the store without the secret can and cannot do."""
from datetime import timedelta

import pytest
import torch.distributed as dist

from megarl.distributed.heartbeat import Heartbeat, HeartbeatMonitor
from megarl.distributed.lifetime import SIGNAL_KEY
from megarl.distributed.signed_store import ForgedStoreValue, SignedStore
from tests.distributed.test_queue import KEY, free_port


@pytest.fixture
def stores():
    """The run's signed view (prefixed as connect_store does) and an outsider's plain client of the same store."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    yield SignedStore(dist.PrefixStore("megarl/attempt0/", server), KEY), outsider
    del outsider


def test_genuine_values_round_trip_and_stay_readable(stores):
    signed, outsider = stores
    signed.set("queue/address", '{"address": "tcp://127.0.0.1:5555"}')
    assert signed.get("queue/address") == b'{"address": "tcp://127.0.0.1:5555"}'
    assert signed.check(["queue/address"])
    # Signing is not encryption: whoever reaches the store reads the value (docs/security.md).
    assert outsider.get("megarl/attempt0//queue/address").startswith(b'{"address"')
    publish = signed.prefixed("stage1/")  # as topology.publish_stage_store
    publish.set("publish/spec", "{}")
    assert publish.get("publish/spec") == b"{}"
    # The same bytes under the key "stage1/publish/spec" (another raw key: PrefixStore adds a "/") are refused.
    outsider.set("megarl/attempt0//stage1/publish/spec", outsider.get("megarl/attempt0//stage1//publish/spec"))
    with pytest.raises(ForgedStoreValue):
        signed.get("stage1/publish/spec")


def test_a_forged_stop_signal_is_not_acted_on(stores, capsys):
    signed, outsider = stores
    outsider.set(f"megarl/attempt0//{SIGNAL_KEY}", "15")
    assert not signed.check([SIGNAL_KEY])  # what raise_if_stopped and the sampler loop ask: the run goes on
    with pytest.raises(ForgedStoreValue, match="not signed with this run's secret"):
        signed.get(SIGNAL_KEY)
    assert "treated as absent" in capsys.readouterr().out
    signed.set(SIGNAL_KEY, "15")  # the genuine writer still can
    assert signed.check([SIGNAL_KEY])


def test_forged_heartbeats_do_not_keep_a_dead_sampler_alive(stores):
    signed, outsider = stores
    monitor = HeartbeatMonitor(signed, [1, 2], timeout_s=60)
    Heartbeat(signed, 1, period_s=0).beat()
    outsider.set("megarl/attempt0//" + monitor.keys[2], "1000")
    monitor.observe()
    assert monitor.last_value == {1: 1, 2: None}  # the forged counter counts as no heartbeat at all
    assert monitor.forged[2] == 1


def test_a_genuine_value_copied_to_another_key_is_refused(stores):
    signed, outsider = stores
    signed.set("publish/header/1", '{"version": 1}')
    outsider.set("megarl/attempt0//publish/header/2", outsider.get("megarl/attempt0//publish/header/1"))
    with pytest.raises(ForgedStoreValue, match="publish/header/2"):
        signed.get("publish/header/2")
    with pytest.raises(ForgedStoreValue):
        SignedStore(signed.raw, b"another run's secret").get("publish/header/1")
