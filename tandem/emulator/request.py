"""One engine request: its tokens, scheduling state, timings and the hand-off to its HTTP stream."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.emulator.sampling import TokenRule


class Status(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED = 4


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class RemotePrefill:
    """What a decode request needs to pull its prompt's KV from a prefill engine (kv_transfer_params)."""

    engine_id: str
    host: str
    port: int
    block_ids: list[int]
    request_id: str
    num_tokens: int


@dataclass(eq=False, slots=True)
class EngineRequest:
    """A request inside the engine (vLLM's own `Request`), apart from the HTTP request it serves."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)  # prompt + output, the KV sequence
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not scheduled yet)
    num_external_tokens: int = 0  # tokens whose KV came from a remote prefill engine
    num_preemptions: int = 0
    cache_salt: str | None = None
    lora: tuple[str, str] | None = None  # (adapter name, path): part of every block's hash
    lora_id: int | None = None  # the adapter's int id (vLLM's deprecated event field)
    block_digests: list[bytes] = field(default_factory=list)
    kv_capacity: int = 0  # tokens that fit in the request's allocated blocks
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    # output generation: a deterministic stream of token ids
    rng_state: int = 1
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    token_rule: TokenRule | None = None  # logit_bias and the min-tokens mask, when they matter
    eos_token_id: int | None = None
    ignore_eos: bool = False
    # speculative decoding: the chance that a drafted token is accepted
    acceptance_rate: float = 0.0
    # P/D
    do_remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None
    kv_ready: bool = False
    kv_failed: bool = False  # the pull failed and the policy is recompute: prefill here
    hold_blocks: list[int] = field(default_factory=list)
    # timings (engine clock, seconds)
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    prefill_done_time: float = 0.0
    # outcome and the hand-off to the HTTP handler
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    waiter: asyncio.Future[None] | None = None
    stall: bool = False
    stall_after: int = 0  # failure injection: stop producing after this many tokens (0: never)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def wake(self) -> None:
        """Tell the HTTP handler that new output (or the end) is there."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
