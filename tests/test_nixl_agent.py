"""NIXL agents in two processes on loopback: descriptors, a WRITE between KV-cache-shaped
tensors with scattered block ids, and a WRITE to a peer that died, which must fail, not hang."""

import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from workers.nixl_agent import NixlAgent, NixlError, block_runs, nixl_module
from workers.nixl_layout import CacheLayout
from workers.transfer_nixl import Grant

needs_nixl = pytest.mark.skipif(nixl_module() is None, reason="NIXL is not installed: pip install 'kvgate[nixl]'")
SHAPE = (3, 2, 20, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim


def test_block_runs_merge_only_what_is_consecutive_on_both_sides():
    ls, rs, lens = block_runs([4, 5, 6, 9, 10, 2], [0, 1, 7, 8, 9, 3])
    assert (ls, rs, lens.tolist()) == ([4, 6, 9, 2], [0, 7, 8, 3], [2, 1, 2, 1])


def test_descriptors_address_every_slice_of_each_run():
    layout = CacheLayout("a", "", "DRAM", 0, base=1000, num_blocks=10, num_slices=2, slice_bytes=8)
    d = layout.descs([3, 7], np.array([2, 1], dtype=np.uint64))
    assert d.tolist() == [[1024, 16, 0], [1056, 8, 0], [1104, 16, 0], [1136, 8, 0]]


def test_a_layout_from_json_refuses_nonsense():
    good = CacheLayout("a", "bWQ=", "DRAM", 0, 1, 2, 3, 4).to_json()
    assert CacheLayout.from_json(good).to_json() == good
    for bad in ({**good, "mem": "DISK"}, {**good, "slice_bytes": 0}, {k: v for k, v in good.items() if k != "base"}):
        with pytest.raises(ValueError):
            CacheLayout.from_json(bad)


def _target(q_layout, q_done, q_result) -> None:
    cache = torch.zeros(SHAPE, dtype=torch.float32)
    agent = NixlAgent("target", cache)
    q_layout.put(agent.layout.to_json())
    while q_done.empty():  # a target progresses until the writer says it is done (UCX over TCP needs it)
        agent.progress()
        time.sleep(0.0005)
    q_result.put(cache.numpy().tobytes())


@needs_nixl
def test_write_lands_in_the_granted_blocks_of_another_process():
    ctx = mp.get_context("spawn")
    q_layout, q_done, q_result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_target, args=(q_layout, q_done, q_result))
    proc.start()
    try:
        src = torch.randn(SHAPE)
        agent = NixlAgent("writer", src)
        peer = CacheLayout.from_json(q_layout.get(timeout=60))
        local, remote = [1, 2, 3, 7, 0], [5, 6, 7, 11, 19]
        moved = agent.write(peer, local, remote, time.monotonic() + 30)
        q_done.put("done")
        got = torch.frombuffer(bytearray(q_result.get(timeout=60)), dtype=torch.float32).view(SHAPE)
        assert moved == len(local) * 3 * 2 * 4 * 2 * 8 * 4
        assert torch.equal(got[:, :, remote], src[:, :, local])
        untouched = [b for b in range(SHAPE[2]) if b not in remote]
        assert not got[:, :, untouched].any()
    finally:
        proc.join(30)
        proc.kill()


def _short_lived(q_layout, q_go) -> None:
    agent = NixlAgent("short-lived", torch.zeros(SHAPE))
    q_layout.put(agent.layout.to_json())
    q_go.get()  # the writer has connected: die now, as a crashed worker would


@needs_nixl
@pytest.mark.parametrize("connected", [False, True])
def test_write_to_a_dead_peer_fails_in_bounded_time(connected):
    ctx = mp.get_context("spawn")
    q_layout, q_go = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_short_lived, args=(q_layout, q_go))
    proc.start()
    agent = NixlAgent("orphan", torch.randn(SHAPE))
    peer = CacheLayout.from_json(q_layout.get(timeout=60))
    if connected:
        agent.connect(peer)
    q_go.put("die")
    proc.join(30)
    with pytest.raises(NixlError):
        agent.write(peer, [0, 1], [0, 1], time.monotonic() + 5)


@needs_nixl
def test_nothing_is_posted_into_a_reservation_past_its_writing_window():
    """A grant whose window has passed (the decode side may have let its blocks go) gets no
    WRITE: the error says nothing is in flight, so the decode side may free the blocks at once."""
    agent = NixlAgent("late", torch.zeros(SHAPE))
    peer = CacheLayout(**{**agent.layout.to_json(), "agent": "never-connected"})
    with pytest.raises(NixlError, match="too old") as e:
        agent.write(peer, [0], [0], time.monotonic())
    assert e.value.settled
    assert "never-connected" not in agent._peers, "not even connected"


@needs_nixl
def test_a_mismatched_layout_is_refused_before_any_write():
    agent = NixlAgent("solo", torch.zeros(SHAPE))
    other = CacheLayout(**{**agent.layout.to_json(), "agent": "x", "slice_bytes": 4})
    with pytest.raises(NixlError, match="does not match"):
        agent.write(other, [0], [0], time.monotonic() + 1)


def test_a_grant_is_checked_against_the_payload_and_the_peers_cache():
    peer = CacheLayout("d", "", "DRAM", 0, base=0, num_blocks=10, num_slices=2, slice_bytes=8)
    ok = Grant.from_json({"id": "g", "agent": "d", "blocks": [3, 9], "positions": [1, 2], "ttl_s": 5})
    assert ok.sources([7, 8, 9], peer) == [8, 9]
    for bad in ({"blocks": [3, 10]}, {"positions": [1, 3]}, {"agent": "e"}, {"blocks": [3]}):
        with pytest.raises(NixlError):
            Grant(**{**ok.to_json(), **bad}).sources([7, 8, 9], peer)
    for bad in ({"ttl_s": 0}, {"ttl_s": "inf"}, {"blocks": ["x"]}):
        with pytest.raises(ValueError):
            Grant.from_json({**ok.to_json(), **bad})
