"""vLLM's response bodies, written once for completions and chat: whole answers, stream chunks,
usage, errors and the model list, field for field and in vLLM's order."""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
from aiohttp import web

from tandem.emulator.errors import INTERNAL_ERROR, APIError
from tandem.emulator.output import Job

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()

# What differs between the two APIs besides the choice's content: the `object` names.
_OBJECT = {True: "chat.completion", False: "text_completion"}
_CHUNK_OBJECT = {True: "chat.completion.chunk", False: "text_completion"}


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_json.encode(body), status=status, content_type="application/json", headers=headers
    )


def error_response(error: APIError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(error.body(), error.status, headers)


def sse_event(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def stream_error_event(message: str = INTERNAL_ERROR, code: int = 500) -> bytes:
    """An error inside an SSE stream (vLLM writes it with json.dumps' default separators)."""
    body = {
        "error": {"message": message, "type": "InternalServerError", "param": None, "code": code}
    }
    return f"data: {json.dumps(body)}\n\n".encode()


def model_list(names: list[str], root: str, created: int, max_model_len: int) -> dict[str, Any]:
    """The body of GET /v1/models: one card per served name."""
    cards = [
        with_permission(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
            }
        )
        for name in names
    ]
    return {"object": "list", "data": cards}


def with_permission(card: dict[str, Any]) -> dict[str, Any]:
    """A model card with vLLM's `permission` list (a fresh id per listing)."""
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": card["created"],
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {**card, "permission": [permission]}


class ResponseShaper:
    """The bodies of one engine's answers (they carry its `system_fingerprint`)."""

    def __init__(self, system_fingerprint: str) -> None:
        self.system_fingerprint = system_fingerprint

    @staticmethod
    def _head(job: Job, chunk: bool) -> dict[str, Any]:
        obj = (_CHUNK_OBJECT if chunk else _OBJECT)[job.chat]
        return {"id": job.public_id, "object": obj, "created": job.created, "model": job.model}

    def completion(self, job: Job) -> dict[str, Any]:
        """The whole answer of a finished non-streaming request."""
        request = job.request
        finish, stop_reason = job.finish()
        output_ids = request.output_token_ids
        usage = {
            "prompt_tokens": request.num_prompt_tokens,
            "total_tokens": request.num_prompt_tokens + len(output_ids),
            "completion_tokens": len(output_ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        # Completions carry the prompt's fields in the choice, chat at the top level.
        prompt = {
            "prompt_logprobs": None,
            "prompt_token_ids": request.prompt_token_ids if job.return_token_ids else None,
        }
        content: dict[str, Any] = (
            {
                "message": {
                    "role": "assistant",
                    "content": job.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                }
            }
            if job.chat
            else {"text": job.text}
        )
        choice = {
            "index": 0,
            **content,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": output_ids if job.return_token_ids else None,
            **({} if job.chat else prompt),
            "routed_experts": None,
        }
        return {
            **self._head(job, chunk=False),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": self.system_fingerprint,
            "usage": usage,
            **({**prompt, "prompt_text": None} if job.chat else {}),
            "kv_transfer_params": request.extra.get("kv_transfer_params"),
            "ec_transfer_params": None,
            "metrics": None,
        }

    def role_chunk(self, job: Job) -> bytes:
        """Chat's first stream event: the assistant role with empty content."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse_event(
            {
                **self._head(job, chunk=True),
                "choices": [choice],
                "prompt_token_ids": job.request.prompt_token_ids if job.return_token_ids else None,
                "prompt_text": None,
            }
        )

    def chunk(
        self,
        job: Job,
        text: str,
        tokens: list[int],
        finish: str | None,
        stop_reason: str | int | None,
        first: bool,
        last: bool,
    ) -> bytes:
        """One stream event with new text; the last one carries the fingerprint."""
        content: dict[str, Any] = {"delta": {"content": text}} if job.chat else {"text": text}
        choice: dict[str, Any] = {"index": 0, **content, "logprobs": None, "finish_reason": finish}
        if not job.chat or finish is not None:
            choice["stop_reason"] = stop_reason
        if not job.chat:
            prompt_ids = job.request.prompt_token_ids if first and job.return_token_ids else None
            choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = tokens if job.return_token_ids else None
        event: dict[str, Any] = {**self._head(job, chunk=True), "choices": [choice]}
        if last:
            event["system_fingerprint"] = self.system_fingerprint
        return sse_event(event)

    def usage_chunk(self, job: Job) -> bytes:
        """The stream's last event with `stream_options.include_usage`: no choices, the usage."""
        prompt_tokens, output_tokens = job.request.num_prompt_tokens, job.sent_tokens
        return sse_event(
            {
                **self._head(job, chunk=True),
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens + output_tokens,
                    "completion_tokens": output_tokens,
                },
                "system_fingerprint": self.system_fingerprint,
            }
        )
