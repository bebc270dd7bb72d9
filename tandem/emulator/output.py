"""One request's output on its way to the client: tokens not sent yet, text, stop strings."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.emulator.request import EngineRequest


@dataclass
class Job:
    """One HTTP completion request and what of its output has been sent."""

    chat: bool
    public_id: str  # cmpl-<id> or chatcmpl-<id>
    model: str
    created: int
    request: EngineRequest
    stream: bool
    include_usage: bool
    return_token_ids: bool
    stop: list[str] = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def done(self) -> bool:
        """The engine finished the request and every token it produced has been taken."""
        request = self.request
        return request.finished and self.sent_tokens >= request.num_output_tokens

    async def next_tokens(self) -> list[int]:
        """Wait for tokens not taken yet (or the end); returns the new token ids."""
        request = self.request
        loop = asyncio.get_running_loop()
        while request.num_output_tokens <= self.sent_tokens and not request.finished:
            request.waiter = loop.create_future()
            await request.waiter
        tokens = request.token_ids[request.num_prompt_tokens + self.sent_tokens :]
        self.sent_tokens += len(tokens)
        return tokens

    def append_text(self, tokens: list[int], token_text: Callable[[int], str]) -> bool:
        """Detokenize new tokens into `text`; True when a stop string cut it (the request ends)."""
        new = "".join(token_text(t) for t in tokens)
        if not self.stop:
            self.text += new
            return False
        start = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
        combined = self.text + new
        for stop in self.stop:
            at = combined.find(stop, start)
            if at >= 0:
                self.text = combined[:at]
                self.finish_reason = "stop"
                self.stop_reason = stop
                return True
        self.text = combined
        return False

    def take_text(self, final: bool) -> str:
        """Text not streamed yet. With stop strings, the last (longest stop - 1) characters are
        held back until the end, since they may begin a stop string (as vLLM does)."""
        end = len(self.text)
        if self.stop and not final:
            end = max(self.sent_chars, end - max(len(s) for s in self.stop) + 1)
        text = self.text[self.sent_chars : end]
        self.sent_chars = end
        return text

    def finish(self) -> tuple[str | None, str | int | None]:
        """(finish_reason, stop_reason) once the output is complete, else (None, None)."""
        if self.finish_reason is not None:
            return self.finish_reason, self.stop_reason
        request = self.request
        if self.done:
            reason = request.finish_reason.value if request.finish_reason else None
            return reason, request.stop_reason
        return None, None
