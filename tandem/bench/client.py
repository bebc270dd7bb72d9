"""Streaming OpenAI client: sends one request and times its first token, each later token and its end."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec

from tandem.bench.workloads import PlannedRequest

# Any `x-tandem-<name>-ms` response header is a stage of the router's per-request breakdown.
BREAKDOWN_HEADER = re.compile(r"^x-tandem-(.+)-ms$", re.IGNORECASE)

Api = Literal["completions", "chat"]


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times are seconds, `start_s` is relative to the run's start."""

    index: int
    klass: str
    phase: str
    start_s: float
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive token chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)  # other x-tandem-* headers (route, engines)
    lag_s: float = 0.0  # how late the client sent it against the schedule

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# the token a hidden-length request is made to end with (every vocabulary has an id 0)
LENGTH_STOP_TOKEN = 0


def request_body(
    planned: PlannedRequest, api: Api, model: str, ignore_eos: bool, length_cap: int | None = None
) -> dict[str, Any]:
    """The JSON body for one planned request.

    `ignore_eos` (a vLLM extension) makes the engine produce exactly `max_tokens` tokens so that
    output lengths follow the workload; turn it off for endpoints that refuse unknown fields.
    With `length_cap`, every request asks for `max_tokens = length_cap` and is made to end at its
    planned length by vLLM's sampling parameters instead: `min_tokens = length - 1` masks the stop
    token until then, `stop_token_ids` and a `logit_bias` of +100 make it the next token, so a
    router in between sees the cap and not the length.
    """
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": planned.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if length_cap is not None:
        body["max_tokens"] = length_cap
        body["min_tokens"] = max(planned.max_tokens - 1, 0)
        body["stop_token_ids"] = [LENGTH_STOP_TOKEN]
        body["logit_bias"] = {str(LENGTH_STOP_TOKEN): 100}
    if api == "completions":
        body["prompt"] = planned.prompt
    elif isinstance(planned.prompt, list):
        raise ValueError("chat requests need a text prompt, not token ids")
    else:
        body_text = (
            planned.prompt[len(planned.prefix) :].lstrip() if planned.prefix else planned.prompt
        )
        messages = [{"role": "system", "content": planned.prefix}] if planned.prefix else []
        body["messages"] = [*messages, {"role": "user", "content": body_text}]
    return body


def breakdown_from_headers(headers: Any) -> tuple[dict[str, float], dict[str, str]]:
    """({stage: milliseconds} from every `x-tandem-<stage>-ms` header, {name: value} of the other
    `x-tandem-*` headers such as the route taken); unparsable stage values are skipped."""
    stages: dict[str, float] = {}
    tags: dict[str, str] = {}
    for name, value in headers.items():
        lowered = name.lower()
        match = BREAKDOWN_HEADER.match(lowered)
        if match is None:
            if lowered.startswith("x-tandem-"):
                tags[lowered.removeprefix("x-tandem-")] = value
            continue
        try:
            # kv-handoff -> kv_handoff: the spelling of the router's histogram of the same stage
            stages[match.group(1).replace("-", "_")] = float(value)
        except ValueError:
            continue
    return stages, tags


_decoder = msgspec.json.Decoder()


def is_token_chunk(chunk: dict[str, Any], api: Api) -> bool:
    """Whether a stream chunk carries a generation step (one or more tokens).

    Text can be empty for a real token (a partial UTF-8 sequence; random-weight models), so the
    test is structural, as vLLM streams: completions — any choice with a `text` field; chat — a
    delta with content, or with a `content` field and no `role` (the first chunk is the role
    announcement, `{"role": "assistant", "content": ""}`, not a token).
    """
    choices = chunk.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    if api == "completions":
        return "text" in choice
    delta = choice.get("delta") or {}
    if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
        return True
    return "content" in delta and "role" not in delta


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: RequestResult,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST `body` to `url` with streaming and fill `result` with the measured times.

    TTFT is the time to the first chunk carrying a token (`is_token_chunk`); each later token
    chunk adds one inter-token gap; e2e ends at `[DONE]`. Token counts come from the usage chunk
    when present (a chunk may carry several tokens), else from the number of token chunks.
    """
    api: Api = "completions" if "prompt" in body else "chat"
    started = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            result.status = response.status
            result.breakdown_ms, result.tags = breakdown_from_headers(response.headers)
            if response.status != 200:
                result.error = (await response.text())[:300]
                return result
            async for raw in response.content:
                now = time.perf_counter()
                if not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    result.e2e_s = now - started
                    break
                chunk = _decoder.decode(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                if is_token_chunk(chunk, api):
                    chunks += 1
                    if last is None:
                        result.ttft_s = now - started
                    else:
                        result.itl_s.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
            if result.e2e_s is None:
                result.e2e_s = time.perf_counter() - started
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.output_tokens = result.output_tokens or chunks
    result.ok = result.ttft_s is not None
    if not result.ok and not result.error:
        result.error = "stream ended without any token"
    return result


async def discover_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id listed by `GET /v1/models`."""
    async with session.get(
        f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)
    ) as response:
        response.raise_for_status()
        listing = await response.json()
    models = listing.get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
