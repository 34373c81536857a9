"""The paged KV cache's bookkeeping: the block allocator's reservations and free list, and PagedKVCache's block
table as slots grow, pack and release (megarl.sampler.kv_blocks, megarl.sampler.model.PagedKVCache)."""
from __future__ import annotations

import pytest
import torch

from megarl.sampler.kv_blocks import BlockAllocator, blocks_for
from megarl.sampler.model import ModelSpec, PagedKVCache

SPEC = ModelSpec(model_type="qwen2", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=True,
                 qkv_bias=True, o_bias=False, mlp_bias=False)


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_reservations_bound_what_is_taken_and_blocks_come_back_lowest_first():
    pool = BlockAllocator(5, 4, first_id=1)
    assert pool.reserve(3) and not pool.reserve(3) and pool.unreserved == 2  # a refused reservation changes nothing
    assert [pool.take(), pool.take()] == [1, 2] and pool.free == 3
    assert pool.reserve(2) and pool.unreserved == 0
    assert [pool.take(), pool.take()] == [3, 4]
    pool.give_back([2, 1], reserved=3)  # the first request ends before taking its third block
    assert (pool.reserved, pool.free, pool.unreserved) == (2, 3, 3)
    assert [pool.take(), pool.take(), pool.take()] == [1, 2, 5]
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.take()


def test_a_pool_needs_a_block():
    with pytest.raises(ValueError, match="sampler.kv_blocks"):
        BlockAllocator(0, 16)


def test_paged_cache_grows_packs_and_releases_slots_through_the_block_table():
    cache = PagedKVCache(SPEC, 3, 16, torch.float32, block_size=4, num_blocks=6)
    assert cache.k.shape == (2, 7, 2, 16, 4) and cache.v.shape == (2, 7, 2, 4, 16)  # (block 0: the sink)
    assert cache.reserve(0, 9) and cache.reserve(1, 8) and not cache.reserve(2, 5)  # 3 + 2 blocks of 6: 1 left, 2 asked
    assert cache.grow([(0, 5), (1, 3)]) == [8, 4]
    assert cache.table.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]]
    assert cache.grow([(0, 9), (1, 4)]) == [12, 4]  # only slot 0 crosses into a new block
    assert cache.table[0].tolist() == [1, 2, 4, 0]
    with pytest.raises(RuntimeError, match="reservation"):
        cache.grow([(1, 9)])
    cache.release([0])  # slot 0 ends: its 3 blocks and its reservation return
    assert cache.allocator.unreserved == 4 and cache.table[0].tolist() == [0, 0, 0, 0]
    cache.pack([1], [0])  # slot 1's request moves to slot 0: its table row, no K/V copy
    assert cache.table.tolist() == [[3, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert cache.blocks == [[3], [], []] and cache.reserved == [2, 0, 0]
    assert cache.reserve(1, 16) and cache.grow([(1, 16)]) == [16]
    assert cache.table[1].tolist() == [1, 2, 4, 5]  # freed blocks first, lowest id first


def test_paged_cache_copies_a_shared_prompt_into_the_copys_own_blocks():
    cache = PagedKVCache(SPEC, 2, 16, torch.float32, block_size=4, num_blocks=4)
    for slot in (0, 1):
        cache.reserve(slot, 6)
    cache.grow([(0, 6), (1, 6)])
    cache.k[:, 1:3] = torch.randn(cache.k[:, 1:3].shape)
    cache.v[:, 1:3] = torch.randn(cache.v[:, 1:3].shape)
    cache.move_slots(torch.tensor([0]), torch.tensor([1]), 6)
    assert torch.equal(cache.k[:, 3:5], cache.k[:, 1:3]) and torch.equal(cache.v[:, 3:5], cache.v[:, 1:3])
    assert cache.table.tolist() == [[1, 2, 0, 0], [3, 4, 0, 0]]  # copied, not shared
