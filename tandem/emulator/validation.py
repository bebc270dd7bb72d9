"""Reads and checks OpenAI request bodies as vLLM's server does: the same messages, params and
statuses, checked in the same order, so that the first problem a client sees is vLLM's."""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from tandem.emulator.errors import APIError, bad_request
from tandem.emulator.tokenizer import PromptTokenizer, render_chat


@dataclass
class Generation:
    """A checked completion or chat request: what the engine runs and how the answer is shaped."""

    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    stop: list[str]
    stop_token_ids: tuple[int, ...]  # the request's own, then EOS unless ignore_eos
    ignore_eos: bool
    cache_salt: str | None
    seed: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id: bias in [-100, 100]
    kv_transfer_params: dict[str, Any] | None = field(default=None)
    # Speculative decoding: this request's draft acceptance (`vllm_xargs.spec_acceptance_rate`).
    acceptance_rate: float | None = None


def json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or vLLM's 400 for malformed JSON or a non-object."""
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


def _acceptance_rate(body: dict[str, Any]) -> float | None:
    """Speculative decoding: the request's own draft acceptance (`vllm_xargs`), if it sets one."""
    xargs = body.get("vllm_xargs")
    acceptance = xargs.get("spec_acceptance_rate") if isinstance(xargs, dict) else None
    return float(acceptance) if isinstance(acceptance, int | float) else None


class RequestValidator:
    """Checks bodies against one served model: its names, tokenizer and context length."""

    def __init__(
        self,
        names: list[str],
        tokenizer: PromptTokenizer,
        max_model_len: int,
        adapters: Container[str] = (),
    ) -> None:
        self.names = names
        self.adapters = adapters  # LoRA adapter names, served too (not listed in the 404)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def model(self, body: dict[str, Any]) -> str:
        """The served name the body asks for (the first one when it names none); 404 if unknown."""
        model = body.get("model")
        if model is None:
            return self.names[0]
        if model not in self.names and model not in self.adapters:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.names)}.",
                "NotFoundError",
                "model",
            )
        return str(model)

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode(render_chat(messages, add_generation_prompt))

    def prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of a completion prompt: a string, token ids, or a one-element list of either."""
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

    def _request_prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if not chat:
            if "prompt" not in body:
                raise bad_request("Field required", "prompt", None)
            return self.prompt_ids(body["prompt"])
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise bad_request("messages must be a non-empty list of objects", "messages", messages)
        return self.chat_ids(messages, body.get("add_generation_prompt", True))

    def max_tokens(self, body: dict[str, Any], prompt_len: int, chat: bool) -> int:
        """Output tokens allowed: the request's limit, else what is left of the context."""
        value = body.get("max_completion_tokens") if chat else None
        if value is None:
            value = body.get("max_tokens")
        max_len = self.max_model_len
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

    def logit_bias(self, body: dict[str, Any]) -> dict[int, float]:
        """`logit_bias` as vLLM reads it: integer keys, biases clamped to [-100, 100], every
        token inside the vocabulary."""
        raw = body.get("logit_bias")
        if raw is None:
            return {}
        if not isinstance(raw, dict) or not all(
            isinstance(b, int | float) and not isinstance(b, bool) for b in raw.values()
        ):
            raise bad_request("logit_bias must map token ids to numbers", "logit_bias", raw)
        bias: dict[int, float] = {}
        invalid_keys: list[Any] = []
        for key, value in raw.items():
            try:
                bias[int(key)] = min(100.0, max(-100.0, float(value)))
            except ValueError:
                invalid_keys.append(key)
        if invalid_keys:
            raise bad_request(
                "logit_bias contains key(s) that cannot be converted to integer token IDs: "
                f"{invalid_keys!r}",
                "logit_bias",
                invalid_keys,
            )
        vocab_size = self.tokenizer.vocab_size
        out_of_vocab = [t for t in bias if t < 0 or t >= vocab_size]
        if out_of_vocab:
            raise bad_request(
                f"token_id(s) {out_of_vocab} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}",
                "logit_bias",
                out_of_vocab,
            )
        return bias

    def generation(self, body: dict[str, Any], chat: bool) -> Generation:
        """Every check of /v1/completions (chat=False) or /v1/chat/completions, in vLLM's order."""
        model = self.model(body)
        prompt_ids = self._request_prompt_ids(body, chat)
        params = body.get("kv_transfer_params")
        params = params if isinstance(params, dict) else None
        given_ids = params.get("prompt_token_ids") if params is not None else None
        if (
            params is not None
            and params.get("do_remote_prefill")
            and isinstance(given_ids, list)
            and given_ids
            and all(isinstance(t, int) for t in given_ids)
        ):
            prompt_ids = list(given_ids)  # the prefill engine's tokens: no re-tokenizing
        n = body.get("n", 1)
        if n not in (None, 1):
            raise bad_request("The engine emulator only supports n=1.", "n", n)
        max_tokens = self.max_tokens(body, len(prompt_ids), chat)
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
        logit_bias = self.logit_bias(body)
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise bad_request("cache_salt must be a non-empty string", "cache_salt", cache_salt)
        ignore_eos = bool(body.get("ignore_eos", False))
        eos = self.tokenizer.eos_token_id
        seed = body.get("seed")
        stream_options = body.get("stream_options") or {}
        return Generation(
            chat=chat,
            model=model,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop=stop,
            stop_token_ids=tuple(int(t) for t in stop_ids)
            + (() if ignore_eos or eos is None else (eos,)),
            ignore_eos=ignore_eos,
            cache_salt=cache_salt,
            seed=int(seed) if isinstance(seed, int) else None,
            stream=bool(body.get("stream", False)),
            include_usage=bool(stream_options.get("include_usage", False))
            if isinstance(stream_options, dict)
            else False,
            return_token_ids=bool(body.get("return_token_ids", False)),
            logit_bias=logit_bias,
            kv_transfer_params=params,
            acceptance_rate=_acceptance_rate(body),
        )
