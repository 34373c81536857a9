"""Host-side bookkeeping of the built-in engine's paged KV cache: which fixed-size blocks of the shared pool are
free, which each slot holds, and how many each running request has reserved.

Pure Python, no tensors (the pool and the device block table are `megarl.sampler.model.PagedKVCache`'s).  The
admission rule that makes a mid-run shortage impossible: a request is admitted only when the pool can *reserve*
the blocks of its worst-case length (prompt + max_new_tokens, capped by max_seq_len); blocks are then taken from
the free list only as the request grows, and its reservation and blocks return when it ends.  So the sum of the
running requests' reservations never exceeds the pool, and every `take` finds a free block.
"""
from __future__ import annotations

import heapq


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold positions [0, positions)."""
    return -(-positions // block_size)


class BlockAllocator:
    """Blocks `first_id .. first_id + num_blocks - 1` of a pool, handed out one at a time under reservations.

    `reserve(n)` sets n blocks aside for one request (False when fewer than n are unreserved); `take()` pops a
    free block against a reservation made before; `give_back(blocks, reserved)` returns a finished request's
    blocks and its reservation.  Blocks are handed out lowest id first (a freed block is reused before an
    untouched one), which keeps a lightly used pool's working set small."""

    def __init__(self, num_blocks: int, block_size: int, first_id: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs >= 1 block of >= 1 position, got {num_blocks} x {block_size} "
                             f"(sampler.kv_blocks, sampler.kv_block_size)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(first_id, first_id + num_blocks))  # a min-heap (sorted is one)
        self.reserved = 0  # blocks promised to running requests (taken or not)

    @property
    def free(self) -> int:
        """Blocks not in any slot."""
        return len(self._free)

    @property
    def unreserved(self) -> int:
        """Blocks a new request can still reserve."""
        return self.num_blocks - self.reserved

    def reserve(self, count: int) -> bool:
        if count > self.unreserved:
            return False
        self.reserved += count
        return True

    def take(self) -> int:
        """One free block for a request that reserved it (RuntimeError if the reservations were broken: a bug)."""
        if not self._free:
            raise RuntimeError(f"KV block pool exhausted with {self.reserved} of {self.num_blocks} blocks reserved: "
                               f"a request grew past its reservation")
        return heapq.heappop(self._free)

    def give_back(self, blocks: list[int], reserved: int) -> None:
        for block in blocks:
            heapq.heappush(self._free, block)
        self.reserved -= reserved
