"""A trace's rows turned into the timed requests of one replay (window, speed, loops, scaling,
caps), and the prefix reuse those requests allow at most."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.spec import Trace
from tandem.bench.traces import TRACE_BLOCK_TOKENS, TraceRow, read_trace


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """One request of a replay: its send time (seconds from the replay's start), its lengths,
    and the ids of its prompt's blocks of `Trace.block_tokens` tokens (the last one partial).
    Equal ids are equal token blocks; `loop` is the pass over the window it belongs to."""

    index: int
    at_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    loop: int = 0


def window(rows: Sequence[TraceRow], spec: Trace) -> list[TraceRow]:
    """The rows with start_s <= at_s < start_s + duration_s (on the file's clock), at most
    max_requests of them, in order."""
    end = math.inf if spec.duration_s is None else spec.start_s + spec.duration_s
    picked = [row for row in rows if spec.start_s <= row.at_s < end]
    return picked[: spec.max_requests] if spec.max_requests is not None else picked


def scaled_input(tokens: int, block_tokens: int, cap: int | None) -> int:
    """max(1, round(tokens * block_tokens / 512)), then at most `cap`."""
    scaled = max(1, round(tokens * block_tokens / TRACE_BLOCK_TOKENS))
    return scaled if cap is None else min(scaled, cap)


def plan_trace(rows: Sequence[TraceRow], spec: Trace) -> list[TimedRequest]:
    """The timed requests of replaying `rows` as `spec` says.

    Send time of a row in pass p: (at_s - first at_s of the window) / speedup + p * period, where
    period = span + span / (n - 1) (one mean gap after the last row; 1 / speedup when n = 1).
    A request keeps the first ceil(input / block_tokens) of its trace block ids; a row without
    ids (or with too few) gets fresh negative ids, used by no other request. In pass p > 0 every
    trace id h becomes h + p * (largest id + 1): a loop repeats arrivals and lengths, never
    prompts, so it adds load and no prefix reuse that the trace does not have.
    """
    picked = window(rows, spec)
    if not picked:
        return []
    first = picked[0].at_s
    span = (picked[-1].at_s - first) / spec.speedup
    period = span + (span / (len(picked) - 1) if len(picked) > 1 else 1 / spec.speedup)
    stride = 1 + max((max(row.hash_ids) for row in picked if row.hash_ids), default=0)
    fresh = 0
    planned: list[TimedRequest] = []
    for loop in range(spec.loops):
        for row in picked:
            tokens = scaled_input(row.input_tokens, spec.block_tokens, spec.max_input_tokens)
            blocks = math.ceil(tokens / spec.block_tokens)
            ids = [h + loop * stride for h in row.hash_ids[:blocks]]
            for _ in range(blocks - len(ids)):
                fresh -= 1
                ids.append(fresh)
            output = row.output_tokens
            if spec.max_output_tokens is not None:
                output = min(output, spec.max_output_tokens)
            planned.append(
                TimedRequest(
                    index=len(planned),
                    at_s=(row.at_s - first) / spec.speedup + loop * period,
                    input_tokens=tokens,
                    output_tokens=output,
                    block_ids=tuple(ids),
                    loop=loop,
                )
            )
    return planned


def trace_requests(spec: Trace) -> list[TimedRequest]:
    """The timed requests of `spec`'s trace file (read, then `plan_trace`)."""
    return plan_trace(read_trace(Path(spec.path), spec.format), spec)


@dataclass(frozen=True, slots=True)
class PrefixBound:
    """What an unbounded prefix cache would hit on a list of requests, in blocks and tokens."""

    blocks: int
    hit_blocks: int
    tokens: int
    hit_tokens: int

    @property
    def block_fraction(self) -> float | None:
        return self.hit_blocks / self.blocks if self.blocks else None

    @property
    def token_fraction(self) -> float | None:
        return self.hit_tokens / self.tokens if self.tokens else None


def prefix_bound(
    requests: Sequence[TimedRequest], block_tokens: int, capacity_blocks: int | None = None
) -> PrefixBound:
    """The prefix reuse one cache allows, requests taken in send order: unbounded, or of
    `capacity_blocks` blocks evicted least recently used first.

    Block j of a request hits when its chain (block_ids[0..j]) was in an earlier request and is
    still cached, and every block before it hit (a prefix cache stops at its first miss):
    block_fraction = hit blocks / blocks. In tokens, a hit block counts
    min(its length, the longest length that chain had before) — a partial last block matches
    only as far as an earlier copy of it went: token_fraction = hit tokens / prompt tokens.
    With a capacity, every block of a request is cached (used) as it arrives, then the least
    recently used chains beyond the capacity are dropped: the hit rate of one cache the size
    of a whole pool's KV with every request routed to its prefix, a reference for what a pool
    of engines can hit, though not a strict bound (it ignores the KV the running requests hold,
    and engines cache blocks of their own size). Engines hit less than the unbounded figure
    even with room to spare: they cache whole blocks of their own size only, and never a
    prompt's last token.
    """
    # Each chain is a node named by (its parent's node, its last id): exact, and one entry per
    # distinct chain. cached[node] is the longest its last block has been, in use order.
    nodes: dict[tuple[int, int], int] = {}
    cached: OrderedDict[int, int] = OrderedDict()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for request in sorted(requests, key=lambda r: r.at_s):
        node = -1
        missed = False
        for j, block_id in enumerate(request.block_ids):
            length = min(block_tokens, request.input_tokens - j * block_tokens)
            node = nodes.setdefault((node, block_id), len(nodes))
            before = cached.pop(node, 0)
            blocks += 1
            tokens += length
            if before and not missed:
                hit_blocks += 1
                hit_tokens += min(length, before)
            else:
                missed = True
            cached[node] = max(before, length)
        while capacity_blocks is not None and len(cached) > capacity_blocks:
            cached.popitem(last=False)
    return PrefixBound(blocks, hit_blocks, tokens, hit_tokens)
