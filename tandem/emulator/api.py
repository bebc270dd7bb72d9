"""vLLM's OpenAI-compatible HTTP surface over the emulated engine (aiohttp): routes and the
request's path through the engine. Checking bodies is `validation`'s job, writing answers
`responses`'."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import zlib
from typing import Any

from aiohttp import web

from tandem.emulator.engine import EmulatedEngine
from tandem.emulator.errors import INTERNAL_ERROR, APIError, bad_request, internal_error
from tandem.emulator.faults import FaultInjector
from tandem.emulator.metrics import build_registry, render
from tandem.emulator.output import Job
from tandem.emulator.pd import parse_remote_prefill
from tandem.emulator.request import FinishReason
from tandem.emulator.responses import (
    DONE,
    SSE_CONTENT_TYPE,
    ResponseShaper,
    error_response,
    json_response,
    model_list,
    stream_error_event,
    with_permission,
)
from tandem.emulator.shutdown import refusal
from tandem.emulator.sleep_api import SleepEndpoints
from tandem.emulator.validation import Generation, RequestValidator, json_body

log = logging.getLogger("tandem.emulator.api")

VLLM_VERSION = "0.32.0"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class OpenAIServer:
    """Routes each endpoint to the engine; one instance per engine."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.names = list(self.config.served_model_names or [self.config.model])
        self.lora = engine.lora
        self.validator = RequestValidator(
            self.names,
            self.tokenizer,
            engine.max_model_len,
            self.lora.adapters if self.lora is not None else (),
        )
        digest = zlib.crc32(self.config.model_dump_json().encode())
        self.shaper = ResponseShaper(f"vllm-{VLLM_VERSION}-{digest:08x}")
        self.registry = build_registry(engine.metrics)
        self.faults = FaultInjector(self.config.faults)
        self.created = int(time.time())
        self.dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0")
        self.in_flight = 0

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
        if self.lora is not None and self.lora.config.runtime_updates:
            r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        if self.dev_mode:
            SleepEndpoints(self.engine).add_routes(r)
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
            return error_response(internal_error())

    # ------------------------------------------------------------------ simple endpoints
    async def health(self, request: web.Request) -> web.Response:
        delay = self.config.faults.health_delay_s
        if delay and self.engine.scheduler.has_work():
            await asyncio.sleep(delay)
        return web.Response(status=503 if self.engine.dead else 200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        body = model_list(self.names, self.config.model, self.created, self.engine.max_model_len)
        if self.lora is not None:
            body["data"] += [with_permission(card) for card in self.lora.models(self.created)]
        return json_response(body)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        assert self.lora is not None
        return web.Response(text=self.lora.load(json_body(await request.read())))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        assert self.lora is not None
        return web.Response(text=self.lora.unload(json_body(await request.read())))

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
        if self.lora is not None:
            stats.update(
                lora_swap_ins=self.lora.swap_ins,
                lora_loads=self.lora.loads,
                lora_waited=self.engine.scheduler.lora_waited,
            )
        return json_response(stats)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            return json_response({"detail": "Not Found"}, 404)
        ok = self.engine.reset_prefix_cache()
        return json_response({"success": ok}, 200 if ok else 400)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = json_body(await request.read())
        self.validator.model(body)
        if "messages" in body:
            tokens = self.validator.chat_ids(
                body["messages"], body.get("add_generation_prompt", True)
            )
        else:
            tokens = self.validator.prompt_ids(body.get("prompt"))
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": self.engine.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = json_body(await request.read())
        self.validator.model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise bad_request("tokens must be a list of integers", "tokens", tokens)
        return json_response({"prompt": self.tokenizer.decode(tokens)})

    # ------------------------------------------------------------------ completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _job(self, http: web.Request, generation: Generation) -> Job:
        """The engine request for a checked body, with its P/D role from kv_transfer_params."""
        base_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
        public_id = f"{'chatcmpl' if generation.chat else 'cmpl'}-{base_id}"
        request = self.engine.new_request(
            f"{public_id}-0-{uuid.uuid4().hex[:8]}",
            generation.prompt_ids,
            generation.max_tokens,
            seed=generation.seed,
            min_tokens=generation.min_tokens,
            stop_token_ids=generation.stop_token_ids,
            logit_bias=generation.logit_bias,
            ignore_eos=generation.ignore_eos,
            cache_salt=generation.cache_salt,
            acceptance_rate=generation.acceptance_rate,
            adapter=self.lora.get(generation.model) if self.lora is not None else None,
        )
        params = generation.kv_transfer_params
        if params is not None and self.engine.connector is not None:
            if params.get("do_remote_decode"):
                request.do_remote_decode = True
            elif params.get("do_remote_prefill"):
                try:
                    request.remote_prefill = parse_remote_prefill(params)
                except (ValueError, TypeError) as error:
                    raise bad_request(str(error), "kv_transfer_params", "...") from error
        return Job(
            chat=generation.chat,
            public_id=public_id,
            model=generation.model,
            created=int(time.time()),
            request=request,
            stream=generation.stream,
            include_usage=generation.include_usage,
            return_token_ids=generation.return_token_ids,
            stop=generation.stop,
        )

    async def _generate(self, http: web.Request, chat: bool) -> web.StreamResponse:
        headers = {}
        if self.config.enable_request_id_headers:
            headers["X-Request-Id"] = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        body = json_body(await http.read())
        job = self._job(http, self.validator.generation(body, chat))
        if self.engine.dead:
            raise internal_error()
        if self.engine.shutting_down:
            raise refusal()
        if self.faults.should_fail():
            self.faults.request_done()
            return error_response(internal_error(), headers)
        self.in_flight += 1
        request = job.request
        self.engine.add_request(request)
        try:
            if job.stream:
                return await self._stream(http, job, headers)
            return await self._complete(job, headers)
        finally:
            self.in_flight -= 1
            if not request.finished:
                self.engine.abort(request)  # the client went away
            self.faults.request_done()

    async def _take_output(self, job: Job) -> list[int]:
        """New tokens, detokenized into the job's text; a stop string ends the request."""
        tokens = await job.next_tokens()
        if job.append_text(tokens, self.tokenizer.token_text):
            self.engine.abort(job.request, FinishReason.STOP)
        return tokens

    async def _complete(self, job: Job, headers: dict[str, str]) -> web.Response:
        while not job.done:
            await self._take_output(job)
        request = job.request
        if request.finish_reason is FinishReason.ERROR:
            return error_response(internal_error(request.error or INTERNAL_ERROR), headers)
        return json_response(self.shaper.completion(job), headers=headers)

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
                tokens = await self._take_output(job)
                if request.finish_reason is FinishReason.ERROR and not tokens:
                    await response.write(stream_error_event(request.error or INTERNAL_ERROR))
                    break
                if first and job.chat:
                    await response.write(self.shaper.role_chunk(job))
                finish, stop_reason = job.finish()
                text = job.take_text(final=finish is not None)
                last = finish is not None and not job.include_usage
                await response.write(
                    self.shaper.chunk(job, text, tokens, finish, stop_reason, first, last)
                )
                first = False
                if finish is not None:
                    if job.include_usage:
                        await response.write(self.shaper.usage_chunk(job))
                    break
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:  # the client went away: abort (in _generate) quietly
            pass
        return response
