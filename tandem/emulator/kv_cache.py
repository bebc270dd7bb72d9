"""Paged KV cache with vLLM's block pool semantics: prefix hits, LRU free queue, KV events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.common.block_hash import HashFunction, block_extra_keys, event_hash
from tandem.emulator.request import EngineRequest

KVEvent = dict[str, Any]


class Block:
    __slots__ = ("block_id", "digest", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.digest: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Doubly linked free list: allocation pops the head (least recently freed), frees append."""

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self.head.next
        if block is None or block is self.tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None
        assert nxt is not None
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def prepend_n(self, blocks: list[Block]) -> None:
        """Put blocks at the head, in order (the first is allocated first)."""
        after = self.head.next
        assert after is not None
        prev = self.head
        for block in blocks:
            prev.next = block
            block.prev = prev
            prev = block
        prev.next = after
        after.prev = prev
        self.num_free += len(blocks)

    def append(self, block: Block) -> None:
        last = self.tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self.tail
        self.tail.prev = block
        self.num_free += 1


class BlockPool:
    """N blocks; block 0 is vLLM's null block. Cached full blocks stay reusable until evicted."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, events: bool
    ) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        self.cached: dict[bytes, dict[int, Block]] = {}
        self.events_enabled = events
        self.events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of usable blocks in use (vLLM's kv_cache_usage_perc)."""
        total = self.num_blocks - 1
        return 1.0 - self.free_queue.num_free / total if total else 0.0

    def cached_block(self, digest: bytes) -> Block | None:
        by_id = self.cached.get(digest)
        if not by_id:
            return None
        return next(iter(by_id.values()))

    def get_new_blocks(self, count: int) -> list[Block]:
        if count > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {count} blocks, {self.free_queue.num_free} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.digest is not None:
                self._evict(block)
            block.ref_cnt += 1
            blocks.append(block)
        return blocks

    def _evict(self, block: Block) -> None:
        digest = block.digest
        assert digest is not None
        by_id = self.cached.get(digest)
        if by_id is not None:
            by_id.pop(block.block_id, None)
            if not by_id:
                del self.cached[digest]
        block.digest = None
        if self.events_enabled:
            self.events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [event_hash(digest)],
                    "medium": "GPU",
                    "group_idx": 0,
                }
            )

    def touch(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: list[Block]) -> None:
        """Release blocks in eviction order. Blocks no longer used join the free queue: cached
        ones at the tail (LRU), ones without a digest at the head, since nothing can hit them."""
        without_digest: list[Block] = []
        queue = self.free_queue
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block is not self.null_block:
                if block.digest is None and self.enable_caching:
                    without_digest.append(block)
                else:
                    queue.append(block)
        if without_digest:
            queue.prepend_n(without_digest)

    def cache_full_blocks(
        self, request: EngineRequest, blocks: list[Block], num_cached: int, num_full: int
    ) -> None:
        """Register blocks [num_cached, num_full) of `request` under their digests (BlockStored)."""
        new_hashes: list[int] = []
        extra_keys: list[Any] = []
        digests = request.block_digests
        for index in range(num_cached, num_full):
            block = blocks[index]
            if block is self.null_block or block.digest is not None:
                continue
            digest = digests[index]
            block.digest = digest
            self.cached.setdefault(digest, {})[block.block_id] = block
            if self.events_enabled:
                new_hashes.append(event_hash(digest))
                # untagged, as vLLM publishes them: the adapter's name, then the salt
                keys = block_extra_keys(index, request.cache_salt, request.lora)
                extra_keys.append(None if keys is None else [key[1] for key in keys])
        if self.events_enabled and new_hashes:
            parent = event_hash(digests[num_cached - 1]) if num_cached > 0 else None
            bs = self.block_size
            self.events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": new_hashes,
                    "parent_block_hash": parent,
                    "token_ids": request.token_ids[num_cached * bs : num_full * bs],
                    "block_size": bs,
                    "lora_id": request.lora_id,
                    "medium": "GPU",
                    "lora_name": request.lora[0] if request.lora else None,
                    "extra_keys": extra_keys,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached digest; only possible when no block is in use (vLLM's rule)."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.digest = None
        if self.events_enabled:
            self.events.append({"type": "AllBlocksCleared"})
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


class KVCacheManager:
    """Per-request block tables on top of the pool: prefix lookup, slot allocation, freeing."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        hash_fn: HashFunction,
        root_digest: bytes,
        events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.root_digest = root_digest
        self.pool = BlockPool(num_blocks, block_size, enable_caching, events)
        self.req_blocks: dict[str, list[Block]] = {}
        # prefix-cache counters in tokens (vLLM's prefix_cache_queries / hits)
        self.queries = 0
        self.hits = 0
        self.on_preempt: Callable[[EngineRequest], None] | None = None

    def update_digests(self, request: EngineRequest) -> None:
        """Extend the request's chain of full-block digests to its current token count."""
        digests = request.block_digests
        bs = self.block_size
        full = len(request.token_ids) // bs
        if len(digests) >= full:
            return
        tokens = request.token_ids
        parent = digests[-1] if digests else self.root_digest
        hash_fn = self.hash_fn
        for index in range(len(digests), full):
            extra = block_extra_keys(index, request.cache_salt, request.lora)
            parent = hash_fn((parent, tuple(tokens[index * bs : (index + 1) * bs]), extra))
            digests.append(parent)

    def get_computed_blocks(self, request: EngineRequest) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks, leaving at least the last token to compute."""
        if not self.enable_caching:
            return [], 0
        self.update_digests(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for digest in request.block_digests[:max_blocks]:
            block = self.pool.cached_block(digest)
            if block is None:
                break
            hits.append(block)
        self.queries += request.num_tokens
        self.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def blocks_needed(self, request: EngineRequest, num_tokens: int, new_computed: int = 0) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + new_computed
        needed = -(-min(num_tokens, self.max_model_len) // self.block_size)
        return max(0, needed - have)

    def allocate_slots(
        self,
        request: EngineRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[Block] | None = None,
        cache: bool = True,
    ) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False when the pool is short."""
        computed = new_computed_blocks or []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        have = (len(blocks) if blocks is not None else 0) + len(computed)
        bs = self.block_size
        need_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        to_allocate = -(-need_tokens // bs) - have
        pool = self.pool
        evictable = sum(1 for b in computed if b.ref_cnt == 0)
        if to_allocate > pool.free_queue.num_free - evictable:
            return False
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            request.num_cached_blocks = len(computed)
        if computed:
            pool.touch(computed)
            blocks.extend(computed)
        if to_allocate > 0:
            blocks.extend(pool.get_new_blocks(to_allocate))
        request.kv_capacity = len(blocks) * bs
        if cache and self.enable_caching:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def cache_blocks(self, request: EngineRequest, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        num_cached = request.num_cached_blocks
        if num_cached >= num_full:
            return
        self.update_digests(request)
        self.pool.cache_full_blocks(
            request, self.req_blocks[request.request_id], num_cached, num_full
        )
        request.num_cached_blocks = num_full

    def block_ids(self, request: EngineRequest) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.request_id, ())]

    def free(self, request: EngineRequest) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        request.num_cached_blocks = 0
        request.kv_capacity = 0
        if blocks:
            blocks.reverse()
            self.pool.free_blocks(blocks)

    def detach(self, request: EngineRequest) -> list[Block]:
        """Take the request's blocks out of its table without freeing them (a P/D lease holds them)."""
        request.num_cached_blocks = 0
        request.kv_capacity = 0
        return self.req_blocks.pop(request.request_id, [])

    def release(self, blocks: list[Block]) -> None:
        blocks = list(reversed(blocks))
        self.pool.free_blocks(blocks)

    def usage(self) -> float:
        return self.pool.usage()

    def num_used_blocks(self) -> int:
        """Blocks held by requests (cached blocks nobody holds count as free, as in usage())."""
        return self.pool.num_blocks - 1 - self.pool.num_free

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
