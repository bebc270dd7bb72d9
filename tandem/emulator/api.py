"""vLLM's OpenAI-compatible HTTP surface over the emulated engine (aiohttp)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from tandem.emulator.engine import EmulatedEngine
from tandem.emulator.faults import FaultInjector
from tandem.emulator.metrics import build_registry, render
from tandem.emulator.pd import INTERNAL_ERROR, parse_remote_prefill
from tandem.emulator.request import EngineRequest, FinishReason
from tandem.emulator.tokenizer import render_chat

log = logging.getLogger("tandem.emulator.api")

VLLM_VERSION = "0.32.0"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()


class APIError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None, value: Any = None) -> APIError:
    if param is not None:
        message = f"{message} (parameter={param}, value={value})"
    return APIError(400, message, "BadRequestError", param)


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_json.encode(body), status=status, content_type="application/json", headers=headers
    )


def error_response(error: APIError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(error.body(), error.status, headers)


def stream_error_event(message: str = INTERNAL_ERROR, code: int = 500) -> bytes:
    """An error inside an SSE stream (vLLM writes it with json.dumps' default separators)."""
    body = {
        "error": {"message": message, "type": "InternalServerError", "param": None, "code": code}
    }
    return f"data: {json.dumps(body)}\n\n".encode()


@dataclass
class Job:
    """One HTTP completion request on its way through the engine."""

    kind: str  # "completion" | "chat"
    public_id: str
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


class OpenAIServer:
    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.names = list(self.config.served_model_names or [self.config.model])
        self.model_name = self.names[0]
        self.registry = build_registry(engine.metrics)
        self.faults = FaultInjector(self.config.faults)
        self.created = int(time.time())
        digest = zlib.crc32(self.config.model_dump_json().encode())
        self.system_fingerprint = f"vllm-{VLLM_VERSION}-{digest:08x}"
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0")
        self.in_flight = 0

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics)
        r.add_get("/load", self.load)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/emulator/stats", self.emulator_stats)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.config.api_key
        if (
            key
            and request.path.startswith("/v1")
            and request.headers.get("Authorization") != f"Bearer {key}"
        ):
            return json_response({"error": "Unauthorized"}, 401)
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except web.HTTPNotFound:
            return json_response({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            return json_response({"detail": "Method Not Allowed"}, 405)
        except APIError as error:
            return error_response(error)
        except web.HTTPException:
            raise
        except Exception:  # like vLLM: an unexpected failure is a JSON 500, not a traceback page
            log.exception("request %s %s failed", request.method, request.path)
            return error_response(APIError(500, INTERNAL_ERROR, "InternalServerError"))

    # ------------------------------------------------------------------ simple endpoints
    async def health(self, request: web.Request) -> web.Response:
        if self.engine.dead:
            return web.Response(status=503)
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.config.model,
                "parent": None,
                "max_model_len": self.engine.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
                        "object": "model_permission",
                        "created": self.created,
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
                ],
            }
            for name in self.names
        ]
        return json_response({"object": "list", "data": cards})

    async def metrics(self, request: web.Request) -> web.Response:
        body = render(self.registry)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def load(self, request: web.Request) -> web.Response:
        if not self.config.enable_server_load_tracking:
            return json_response({"detail": "Not Found"}, 404)
        return json_response({"server_load": self.in_flight})

    async def emulator_stats(self, request: web.Request) -> web.Response:
        stats = self.engine.stats.as_dict()
        stats.update(
            engine_id=self.engine.engine_id,
            num_gpu_blocks=self.engine.num_gpu_blocks,
            kv_cache_usage=self.engine.kv.usage(),
            running=len(self.engine.scheduler.running),
            waiting=len(self.engine.scheduler.waiting),
        )
        return json_response(stats)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            return json_response({"detail": "Not Found"}, 404)
        ok = self.engine.reset_prefix_cache()
        return json_response({"success": ok}, 200 if ok else 400)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._check_model(body)
        if "messages" in body:
            tokens = self.tokenizer.encode(
                render_chat(body["messages"], body.get("add_generation_prompt", True))
            )
        else:
            tokens = self._prompt_tokens(body.get("prompt"))
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": self.engine.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise bad_request("tokens must be a list of integers", "tokens", tokens)
        return json_response({"prompt": self.tokenizer.decode(tokens)})

    # ------------------------------------------------------------------ parsing
    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as error:
            detail = {
                "type": "json_invalid",
                "loc": f"body.{error.pos}",
                "msg": "JSON decode error",
                "input": "<dict of 0 items>",
                "ctx": {"error": error.msg},
            }
            raise APIError(
                400, f"1 validation error:\n  {detail}", "Bad Request", f"body.{error.pos}"
            ) from error
        if not isinstance(body, dict):
            raise APIError(400, "Input should be a valid dictionary", "Bad Request", "body")
        return body

    def _check_model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.model_name
        if model not in self.names:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.names)}.",
                "NotFoundError",
                "model",
            )
        return str(model)

    def _prompt_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("Prompt cannot be empty", "prompt", prompt)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise bad_request(
                "Batched prompts are not supported by the engine emulator", "prompt", "[...]"
            )
        raise bad_request(
            "prompt must be a string, a list of token ids, or a one-element list", "prompt", prompt
        )

    def _max_tokens(self, body: dict[str, Any], prompt_len: int, chat: bool) -> int:
        value = body.get("max_completion_tokens") if chat else None
        if value is None:
            value = body.get("max_tokens")
        max_len = self.engine.max_model_len
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad_request("max_tokens must be an integer", "max_tokens", value)
            if value < 1:
                raise bad_request(
                    f"max_tokens must be at least 1, got {value}.", "max_tokens", value
                )
            if value > max_len:
                raise bad_request(
                    f"max_tokens={value} cannot be greater than max_model_len={max_len}. "
                    "Please request fewer output tokens.",
                    "max_tokens",
                    value,
                )
        if prompt_len >= max_len:
            raise bad_request(
                f"The prompt (total length {prompt_len}) is too long to fit into the model "
                f"(context length {max_len}). Make sure that `max_model_len` is no smaller than the "
                "number of text tokens.",
                "input_tokens",
                prompt_len,
            )
        if value is None:
            return max_len - prompt_len
        if prompt_len + value > max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{value} output tokens and your prompt contains at least {prompt_len} input tokens, "
                f"for a total of at least {prompt_len + value} tokens. Please reduce the length of "
                "the input prompt or the number of requested output tokens.",
                "input_tokens",
                prompt_len,
            )
        return value

    # ------------------------------------------------------------------ completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    def _build_job(self, http: web.Request, body: dict[str, Any], kind: str) -> Job:
        model = self._check_model(body)
        chat = kind == "chat"
        if chat:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) for m in messages)
            ):
                raise bad_request(
                    "messages must be a non-empty list of objects", "messages", messages
                )
            prompt_ids = self.tokenizer.encode(
                render_chat(messages, body.get("add_generation_prompt", True))
            )
        else:
            if "prompt" not in body:
                raise bad_request("Field required", "prompt", None)
            prompt_ids = self._prompt_tokens(body["prompt"])
        params = body.get("kv_transfer_params")
        given_ids = params.get("prompt_token_ids") if isinstance(params, dict) else None
        if (
            isinstance(params, dict)
            and params.get("do_remote_prefill")
            and isinstance(given_ids, list)
            and given_ids
            and all(isinstance(t, int) for t in given_ids)
        ):
            prompt_ids = list(given_ids)  # the prefill engine's tokens: no re-tokenizing
        n = body.get("n", 1)
        if n not in (None, 1):
            raise bad_request("The engine emulator only supports n=1.", "n", n)
        max_tokens = self._max_tokens(body, len(prompt_ids), chat)
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be a string or a list of strings", "stop", stop)
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
            raise bad_request(
                "stop_token_ids must be a list of integers", "stop_token_ids", stop_ids
            )
        min_tokens = body.get("min_tokens") or 0
        if not isinstance(min_tokens, int) or min_tokens < 0:
            raise bad_request("min_tokens must be a non-negative integer", "min_tokens", min_tokens)
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise bad_request("cache_salt must be a non-empty string", "cache_salt", cache_salt)
        ignore_eos = bool(body.get("ignore_eos", False))
        eos = self.tokenizer.eos_token_id
        stop_token_ids = tuple(int(t) for t in stop_ids) + (
            () if ignore_eos or eos is None else (eos,)
        )
        base_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        prefix = "chatcmpl" if chat else "cmpl"
        public_id = f"{prefix}-{base_id}"
        internal_id = f"{public_id}-0-{uuid.uuid4().hex[:8]}"
        seed = body.get("seed")
        xargs = body.get("vllm_xargs")
        acceptance = xargs.get("spec_acceptance_rate") if isinstance(xargs, dict) else None
        engine_request = self.engine.new_request(
            internal_id,
            prompt_ids,
            max_tokens,
            seed=int(seed) if isinstance(seed, int) else None,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            cache_salt=cache_salt,
            acceptance_rate=float(acceptance) if isinstance(acceptance, int | float) else None,
        )
        if isinstance(params, dict) and self.engine.connector is not None:
            if params.get("do_remote_decode"):
                engine_request.do_remote_decode = True
            elif params.get("do_remote_prefill"):
                try:
                    engine_request.remote_prefill = parse_remote_prefill(params)
                except (ValueError, TypeError) as error:
                    raise bad_request(str(error), "kv_transfer_params", "...") from error
        stream_options = body.get("stream_options") or {}
        return Job(
            kind=kind,
            public_id=public_id,
            model=model,
            created=int(time.time()),
            request=engine_request,
            stream=bool(body.get("stream", False)),
            include_usage=bool(stream_options.get("include_usage", False))
            if isinstance(stream_options, dict)
            else False,
            return_token_ids=bool(body.get("return_token_ids", False)),
            stop=stop,
        )

    async def _generate(self, http: web.Request, kind: str) -> web.StreamResponse:
        headers = {}
        if self.config.enable_request_id_headers:
            headers["X-Request-Id"] = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        body = await self._body(http)
        job = self._build_job(http, body, kind)
        if self.engine.dead:
            raise APIError(500, INTERNAL_ERROR, "InternalServerError")
        if self.faults.should_fail():
            self.faults.request_done()
            return error_response(APIError(500, INTERNAL_ERROR, "InternalServerError"), headers)
        self.in_flight += 1
        engine = self.engine
        request = job.request
        engine.add_request(request)
        try:
            if job.stream:
                return await self._stream(http, job, headers)
            return await self._complete(job, headers)
        finally:
            self.in_flight -= 1
            if not request.finished:
                engine.abort(request)  # the client went away
            self.faults.request_done()

    async def _next_output(self, job: Job) -> list[int]:
        """Wait for tokens not sent yet (or the end); returns the new token ids."""
        request = job.request
        loop = asyncio.get_running_loop()
        while request.num_output_tokens <= job.sent_tokens and not request.finished:
            request.waiter = loop.create_future()
            await request.waiter
        tokens = request.token_ids[request.num_prompt_tokens + job.sent_tokens :]
        job.sent_tokens += len(tokens)
        return tokens

    def _append_text(self, job: Job, tokens: list[int]) -> None:
        """Detokenize new tokens into job.text; a stop string cuts it and ends the request."""
        token_text = self.tokenizer.token_text
        new = "".join(token_text(t) for t in tokens)
        if not job.stop:
            job.text += new
            return
        start = max(0, len(job.text) - max(len(s) for s in job.stop) + 1)
        combined = job.text + new
        for stop in job.stop:
            at = combined.find(stop, start)
            if at >= 0:
                job.text = combined[:at]
                job.finish_reason = "stop"
                job.stop_reason = stop
                self.engine.abort(job.request, FinishReason.STOP)
                return
        job.text = combined

    def _take_text(self, job: Job, final: bool) -> str:
        """Text not streamed yet. With stop strings, the last (longest stop - 1) characters are
        held back until the end, since they may begin a stop string (as vLLM does)."""
        end = len(job.text)
        if job.stop and not final:
            end = max(job.sent_chars, end - max(len(s) for s in job.stop) + 1)
        text = job.text[job.sent_chars : end]
        job.sent_chars = end
        return text

    def _finish_info(self, job: Job) -> tuple[str | None, str | int | None]:
        if job.finish_reason is not None:
            return job.finish_reason, job.stop_reason
        request = job.request
        if request.finished and job.sent_tokens >= request.num_output_tokens:
            reason = request.finish_reason.value if request.finish_reason else None
            return reason, request.stop_reason
        return None, None

    async def _complete(self, job: Job, headers: dict[str, str]) -> web.Response:
        request = job.request
        while True:
            tokens = await self._next_output(job)
            self._append_text(job, tokens)
            if request.finished and job.sent_tokens >= request.num_output_tokens:
                break
        if request.finish_reason is FinishReason.ERROR:
            return error_response(
                APIError(500, request.error or INTERNAL_ERROR, "InternalServerError"), headers
            )
        finish, stop_reason = self._finish_info(job)
        output_ids = request.output_token_ids
        usage = {
            "prompt_tokens": request.num_prompt_tokens,
            "total_tokens": request.num_prompt_tokens + len(output_ids),
            "completion_tokens": len(output_ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        token_ids = output_ids if job.return_token_ids else None
        prompt_ids = request.prompt_token_ids if job.return_token_ids else None
        kv_params = request.extra.get("kv_transfer_params")
        if job.kind == "chat":
            message = {
                "role": "assistant",
                "content": job.text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
                "routed_experts": None,
            }
            body: dict[str, Any] = {
                "id": job.public_id,
                "object": "chat.completion",
                "created": job.created,
                "model": job.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids,
                "prompt_text": None,
                "kv_transfer_params": kv_params,
                "ec_transfer_params": None,
                "metrics": None,
            }
        else:
            choice = {
                "index": 0,
                "text": job.text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids,
                "routed_experts": None,
            }
            body = {
                "id": job.public_id,
                "object": "text_completion",
                "created": job.created,
                "model": job.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": self.system_fingerprint,
                "usage": usage,
                "kv_transfer_params": kv_params,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return json_response(body, headers=headers)

    def _chunk(
        self,
        job: Job,
        text: str,
        tokens: list[int],
        finish: str | None,
        stop_reason: str | int | None,
        first: bool,
        last: bool,
    ) -> bytes:
        token_ids = tokens if job.return_token_ids else None
        if job.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            if finish is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = token_ids
            obj = "chat.completion.chunk"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "prompt_token_ids": None,
                "token_ids": token_ids,
            }
            if first and job.return_token_ids:
                choice["prompt_token_ids"] = job.request.prompt_token_ids
            obj = "text_completion"
        chunk: dict[str, Any] = {
            "id": job.public_id,
            "object": obj,
            "created": job.created,
            "model": job.model,
            "choices": [choice],
        }
        if last:
            chunk["system_fingerprint"] = self.system_fingerprint
        return b"data: " + _json.encode(chunk) + b"\n\n"

    async def _stream(
        self, http: web.Request, job: Job, headers: dict[str, str]
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200, headers={"Content-Type": SSE_CONTENT_TYPE, **headers}
        )
        await response.prepare(http)
        request = job.request
        first = True
        try:
            while True:
                tokens = await self._next_output(job)
                if request.finish_reason is FinishReason.ERROR and not tokens:
                    await response.write(stream_error_event(request.error or INTERNAL_ERROR))
                    break
                if first and job.kind == "chat":
                    role = {
                        "id": job.public_id,
                        "object": "chat.completion.chunk",
                        "created": job.created,
                        "model": job.model,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        "prompt_token_ids": request.prompt_token_ids
                        if job.return_token_ids
                        else None,
                        "prompt_text": None,
                    }
                    await response.write(b"data: " + _json.encode(role) + b"\n\n")
                self._append_text(job, tokens)
                finish, stop_reason = self._finish_info(job)
                text = self._take_text(job, final=finish is not None)
                last = finish is not None and not job.include_usage
                await response.write(
                    self._chunk(job, text, tokens, finish, stop_reason, first, last)
                )
                first = False
                if finish is not None:
                    if job.include_usage:
                        n_out = job.sent_tokens
                        usage: dict[str, Any] = {
                            "id": job.public_id,
                            "object": "chat.completion.chunk"
                            if job.kind == "chat"
                            else "text_completion",
                            "created": job.created,
                            "model": job.model,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": request.num_prompt_tokens,
                                "total_tokens": request.num_prompt_tokens + n_out,
                                "completion_tokens": n_out,
                            },
                            "system_fingerprint": self.system_fingerprint,
                        }
                        await response.write(b"data: " + _json.encode(usage) + b"\n\n")
                    break
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:  # the client went away: abort (in _generate) quietly
            pass
        return response
