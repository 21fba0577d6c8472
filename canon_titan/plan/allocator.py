"""PyTorch's CUDA caching allocator, replayed over a recorded step's allocations and frees: what
``torch.cuda.max_memory_reserved`` (TorchTitan's logged ``memory:`` figure) reaches, where the
live tensors' peak is only what ``max_memory_allocated`` would show.

Two modes: a training process runs with expandable segments unless its environment says otherwise
(``tools.cuda_allocator``), and ``replay`` takes the mode. The rules are those of
``c10/cuda/CUDACachingAllocator.cpp``; with its default settings (``CachingAllocator``: no
expandable segments, nothing released to the driver while memory lasts):

- a request is rounded up to a multiple of 512 bytes;
- requests of at most 1 MiB come from the small pool, larger ones from the large pool;
- a request takes the smallest free block of its pool and stream that is large enough (best fit,
  the lower address on a tie) and splits it when the rest is at least 512 bytes (small pool) or
  more than 1 MiB (large pool);
- with no such block it reserves a new segment from the driver: 2 MiB for a small request, 20 MiB
  for a large one under 10 MiB, the request rounded up to 2 MiB above that;
- a freed block merges with its free neighbours in the same segment;
- segments are given back only when a new one would not fit the GPU (``capacity``): then every
  segment with nothing allocated in it is released (``release_cached_blocks``, after a device
  synchronize: an "allocation retry", which TorchTitan's log counts) and the reservation is tried
  again; if it still does not fit, the run is out of memory. (``release_available_cached_blocks``,
  tried first, does nothing without a ``max_split_size_mb``.)

With ``expandable_segments:True`` (``ExpandingAllocator``) each stream's pool is one range of
address space (larger than the GPU's memory) that the allocator maps in pages, 2 MiB for the small
pool and 20 MiB for the large one:

- a request takes the smallest free mapped block that is large enough, passing over one that borders
  unmapped space for a larger one that does not (best fit by the size a block could grow to);
- with no such block, the lowest unmapped range that can hold it, with the free block before it and
  any free or unmapped ones after it, is mapped (the part needed, in whole pages) and merged;
- any block splits when the rest is at least 512 bytes, in either pool;
- when a mapping would not fit the GPU, every free block's whole pages are unmapped, and the mapping
  is tried again.

Blocks belong to the stream that allocated them: memory freed by one stream is not reused by
another. FSDP2 allocates its all-gather outputs on its all-gather copy-in stream and its
reduce-scatter buffers on its reduce-scatter stream (``torch.distributed.fsdp``'s
``_fsdp_collectives``), so they fragment apart from the compute stream's blocks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """The bytes a request of ``nbytes`` takes from a block."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(nbytes: int) -> int:
    """The segment reserved from the driver for a (rounded) request that no free block serves."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    segment: int
    offset: int
    size: int
    stream: int
    small: bool
    allocated: bool = False
    mapped: bool = True
    """Always, but for an expandable segment's unmapped address space."""
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class CachingAllocator:
    capacity: int | None = None
    """The bytes the driver can give the allocator (None: unbounded)."""
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    retries: int = 0
    """Times a new segment did not fit and the cached free segments were released."""
    _free: dict[tuple[int, bool], list] = field(default_factory=dict)
    """(stream, small pool) -> free blocks, sorted by (size, segment, offset)."""
    _segments: int = 0

    def _pool(self, stream: int, small: bool) -> list:
        return self._free.setdefault((stream, small), [])

    def _insert(self, block: Block) -> None:
        pool = self._pool(block.stream, block.small)
        bisect.insort(pool, (block.key(), block))

    def _remove(self, block: Block) -> None:
        pool = self._pool(block.stream, block.small)
        i = bisect.bisect_left(pool, (block.key(),))
        while pool[i][1] is not block:
            i += 1
        del pool[i]

    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pool(stream, small)
        i = bisect.bisect_left(pool, ((size, -1, -1),))
        if i < len(pool):
            block = pool.pop(i)[1]
        else:
            total = segment_size(size)
            if self.capacity is not None and self.reserved + total > self.capacity:
                self.retries += 1
                self._release_cached()  # if still over capacity: out of memory (reserved past it)
            block = Block(self._segments, 0, total, stream, small)
            self._segments += 1
            self.reserved += total
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            remaining = Block(
                block.segment, block.offset + size, rest, stream, small, prev=block, next=block.next
            )
            if block.next is not None:
                block.next.prev = remaining
            block.next = remaining
            block.size = size
            self._insert(remaining)
        return self._take(block)

    def _take(self, block: Block) -> Block:
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _release_cached(self) -> None:
        """Give back every segment with nothing allocated in it (one free block, unsplit)."""
        for key, pool in self._free.items():
            whole = [entry for entry in pool if entry[1].prev is None and entry[1].next is None]
            for entry in whole:
                self.reserved -= entry[1].size
            self._free[key] = [
                entry for entry in pool if entry[1].prev is not None or entry[1].next is not None
            ]

    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated or not neighbour.mapped:
                continue
            self._remove(neighbour)
            _absorb(block, neighbour)
        self._insert(block)


def _absorb(block: Block, neighbour: Block) -> None:
    """Merge ``neighbour`` (the block before or after ``block``) into ``block``."""
    if neighbour is block.prev:
        block.offset = neighbour.offset
        block.prev = neighbour.prev
        if neighbour.prev is not None:
            neighbour.prev.next = block
    else:
        block.next = neighbour.next
        if neighbour.next is not None:
            neighbour.next.prev = block
    block.size += neighbour.size


def _split(block: Block, size: int) -> Block:
    """Cut ``block`` to ``size`` bytes; the rest becomes the next block (unallocated, mapped
    alike)."""
    rest = Block(
        block.segment,
        block.offset + size,
        block.size - size,
        block.stream,
        block.small,
        mapped=block.mapped,
        prev=block,
        next=block.next,
    )
    if block.next is not None:
        block.next.prev = rest
    block.next = rest
    block.size = size
    return rest


PAGE = {True: SMALL_BUFFER, False: LARGE_BUFFER}
"""Small pool, large pool -> the page an expandable segment is mapped and unmapped in."""
ADDRESS_SPACE = 1 << 50
"""Of each expandable segment (torch reserves 1 1/8 of the GPU's memory): more than any request."""


def _up(nbytes: int, page: int) -> int:
    return -(-nbytes // page) * page


@dataclass
class ExpandingAllocator(CachingAllocator):
    """The caching allocator with ``expandable_segments:True`` (the rules in the module's
    docstring)."""

    _heads: dict[tuple[int, bool], Block] = field(default_factory=dict)
    """(stream, small pool) -> the first block of its address space."""

    def _blocks(self, stream: int, small: bool):
        if (stream, small) not in self._heads:
            self._heads[(stream, small)] = Block(
                self._segments, 0, ADDRESS_SPACE, stream, small, mapped=False
            )
            self._segments += 1
        block = self._heads[(stream, small)]
        while block is not None:
            yield block
            block = block.next

    def _settle(self, block: Block) -> None:
        """Keep the head of ``block``'s address space (a merge may have taken it into ``block``)."""
        if block.prev is None:
            self._heads[(block.stream, block.small)] = block

    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(stream, small, size)
        if block is None:
            start, pages = self._room(stream, small, size)
            if self.capacity is not None and self.reserved + pages > self.capacity:
                self.retries += 1
                self._release_cached()  # if still over capacity: out of memory (mapped past it)
                start, pages = self._room(stream, small, size)
            block = self._grow(start, size)
        if block.size - size >= MIN_BLOCK:
            self._insert(_split(block, size))
        return self._take(block)

    def _best_fit(self, stream: int, small: bool, size: int) -> Block | None:
        pool = self._pool(stream, small)
        i = bisect.bisect_left(pool, ((size, -1, -1),))
        if i == len(pool):
            return None

        def reach(block: Block) -> int:
            return block.size + (
                block.next.size if block.next is not None and not block.next.mapped else 0
            )

        while i + 1 < len(pool) and reach(pool[i + 1][1]) < reach(pool[i][1]):
            i += 1
        return pool.pop(i)[1]

    def _room(self, stream: int, small: bool, size: int) -> tuple[Block, int]:
        """Where the request's address space starts (an unmapped block, or the free block before
        it), and the bytes of pages that must be mapped there."""
        page = PAGE[small]
        for block in self._blocks(stream, small):
            if block.mapped:
                continue
            start = block.prev if block.prev is not None and not block.prev.allocated else block
            have, pages, part = 0, 0, start
            while have < size and part is not None and not part.allocated:
                mapping = part.size if part.mapped else min(_up(size - have, page), part.size)
                pages += 0 if part.mapped else mapping
                have += mapping
                part = part.next
            if have >= size:
                return start, pages
        raise AssertionError("an expandable segment's address space is never used up")

    def _grow(self, start: Block, size: int) -> Block:
        """Map the pages ``_room`` found from ``start`` on: one free block of at least ``size``,
        taken."""
        block = start if start.mapped else self._map(start, size)
        while block.size < size:
            block = self._map(block.next, size - block.size)
        self._remove(block)
        return block

    def _map(self, unmapped: Block, nbytes: int) -> Block:
        """Map the pages holding the first ``nbytes`` of ``unmapped``, merged with the free mapped
        blocks either side into one free block."""
        pages = min(_up(nbytes, PAGE[unmapped.small]), unmapped.size)
        if pages < unmapped.size:
            _split(unmapped, pages)
        unmapped.mapped = True
        self.reserved += pages
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        for neighbour in (unmapped.prev, unmapped.next):
            if neighbour is not None and neighbour.mapped and not neighbour.allocated:
                self._remove(neighbour)
                _absorb(unmapped, neighbour)
        self._settle(unmapped)
        self._insert(unmapped)
        return unmapped

    def _release_cached(self) -> None:
        """Unmap the whole pages of every free block."""
        for pool in list(self._free.values()):
            for _, block in list(pool):
                page = PAGE[block.small]
                low, high = _up(block.offset, page), (block.offset + block.size) // page * page
                if high <= low:
                    continue
                self._remove(block)
                if low > block.offset:
                    before, block = block, _split(block, low - block.offset)
                    self._insert(before)
                if high < block.offset + block.size:
                    self._insert(_split(block, high - block.offset))
                block.mapped = False
                self.reserved -= high - low
                for neighbour in (block.prev, block.next):
                    if neighbour is not None and not neighbour.mapped:
                        _absorb(block, neighbour)
                self._settle(block)

    def free(self, block: Block) -> None:
        super().free(block)
        self._settle(block)


def replay(
    events,
    *,
    streams: dict[int, int] | None = None,
    persistent: set[int] = frozenset(),
    steps: int = 2,
    capacity: int | None = None,
    expandable: bool = False,
) -> CachingAllocator:
    """Replay a step's ``(op index, storage id, change in bytes)`` events ``steps`` times through
    the allocator. ``streams``: storage id -> the stream that allocates it (0, the compute stream,
    for the others). ``persistent``: storages that outlive a step (parameters, buffers, optimizer
    state), allocated once; whatever else is alive at the end of a step is freed before the next
    (the gradients, which the next step's ``zero_grad`` drops). A storage resized in place (FSDP2's
    gathered parameters) frees its block and takes a new one. ``capacity``: the bytes the GPU
    leaves the allocator. ``expandable``: with expandable segments."""
    streams = streams or {}
    allocator = (ExpandingAllocator if expandable else CachingAllocator)(capacity)
    blocks: dict[int, Block] = {}
    sizes: dict[int, int] = {}
    for step in range(steps):
        for _, sid, delta in events:
            if step and sid in persistent:
                continue
            old = sizes.get(sid, 0)
            new = max(old + delta, 0)
            if new == old:
                continue
            if old:
                allocator.free(blocks.pop(sid))
            if new:
                blocks[sid] = allocator.malloc(new, streams.get(sid, 0))
            sizes[sid] = new
        for sid in [sid for sid in blocks if sid not in persistent]:
            allocator.free(blocks.pop(sid))
            sizes[sid] = 0
    return allocator
