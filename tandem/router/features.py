"""Request features for routing: prompt length in tokens and the prompt's block keys.

With the model's tokenizer (`--tokenizer DIR`) the keys are exact: the token ids vLLM computes
for the request (`tokenization.py`: completions with `add_special_tokens`, chat through the
model's chat template), cut into the blocks the engines hash, so they meet the KV-event index;
`--tokenizer tandem-fallback` is exact for `tandem emulate` engines that have no tokenizer.json
(see fallback_tokenizer.py). A tokenizer class the router does not reproduce
(`tokenizer_classes.py`) leaves it without a tokenizer: every request is then counted as
`tokenizer_class` and takes the approximation (or vLLM's renderer when configured). A request the
router cannot tokenize exactly (a template error, a content part it does not render) is counted in `tandem_router_tokenize_fallbacks_total` and
takes the approximation, as every request does without a tokenizer: the prompt text (chat:
`"{role}: {content}\\n"` per message, then `"assistant:"` unless `add_generation_prompt` is
false) is cut into chunks of 4 x block_size characters (about one block at ~4 characters per
token) and the token count is estimated as characters / 4; those keys only meet the approximate
index built from the router's own routing history.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.router.auth import EngineKey
from tandem.router.blocks import (
    block_keys,
    chain_seed,
    stable_first_block_key,
    stable_text_key,
    text_block_keys,
)
from tandem.router.chat_template import TemplateUnrenderable
from tandem.router.fallback_tokenizer import FALLBACK_TOKENIZER, fallback_token_ids
from tandem.router.hf_tokenizer import HfTokenizer, UnsupportedTokenizer
from tandem.router.render_client import RenderClient, RenderUnavailable
from tandem.router.tokenization import RequestTokenizer, load_template_override

if TYPE_CHECKING:
    from tandem.router.config import RouterConfig
    from tandem.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Features:
    prompt_tokens: int
    keys: list[int]
    exact: bool  # keys come from real token ids (they can meet the KV-event index)
    # the first block's key as every router process computes it (None without a full block)
    first_block_key: int | None = None
    # the LoRA adapter the request names (None: the base model); part of every block's key
    adapter: str | None = None


class Featurizer:
    """Turns an OpenAI request body into `Features`; caches recent prompts (exact repeats).

    A cache collision needs two requests whose canonical JSON has equal length and equal 64-bit
    hash; it could only misplace one request, never change what an engine computes.
    """

    def __init__(
        self,
        block_size: int,
        tokenizer_dir: str | None = None,
        cache_size: int = 1024,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        on_fallback: Callable[[str], None] | None = None,
        render: RenderClient | None = None,
        render_all: bool = False,
        base_models: frozenset[str] = frozenset(),
    ):
        self.block_size = block_size
        # any other model a request names is a LoRA adapter (the engines 404 an unknown one)
        self.base_models = base_models
        # vLLM's renderer: for every request (render_all), else for those the router declines
        self._render = render
        self._render_all = render_all and render is not None
        self._requests: RequestTokenizer | None = None
        self._fallback_ids = tokenizer_dir == FALLBACK_TOKENIZER
        # why the model's tokenizer is not reproduced (its class), when it is not
        self.tokenizer_issue: str | None = None
        if tokenizer_dir and not self._fallback_ids:
            try:
                tokenizer = HfTokenizer.from_directory(tokenizer_dir)
            except UnsupportedTokenizer as exc:
                self.tokenizer_issue = str(exc)
                log.warning(
                    "tokenizer %s: %s; %s",
                    tokenizer_dir,
                    exc,
                    "token ids come from vLLM's renderer (renderUrl)"
                    if render is not None
                    else "routing on the approximation (no exact prefix hits; counted in "
                    'tandem_router_tokenize_fallbacks_total{reason="tokenizer_class"})',
                )
            else:
                self._requests = RequestTokenizer(
                    tokenizer, load_template_override(chat_template), chat_template_kwargs
                )
        self._on_fallback = on_fallback
        # (hash, length, chat flag or salt) of the request -> its features
        self._cache: OrderedDict[tuple[int, int, object], Features] = OrderedDict()
        self._cache_size = cache_size

    def adapter_of(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter a request names: its `model` unless that is the base model."""
        model = body.get("model")
        if not isinstance(model, str) or not self.base_models or model in self.base_models:
            return None
        return model

    @property
    def exact(self) -> bool:
        return self._requests is not None or self._fallback_ids or self._render is not None

    async def features(self, body: dict[str, Any], chat: bool) -> Features:
        """`of_body`, with vLLM's renderer asked when configured (see `render_client.py`)."""
        if self._render is None:
            return self.of_body(body, chat)
        if not self._render_all:
            features = self.of_body(body, chat, count_fallback=False)
            if features.exact:
                return features
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        try:
            ids = await self._render.token_ids(body, chat)
            return self.of_tokens(ids, salt, self.adapter_of(body))
        except RenderUnavailable as exc:
            return self._fallback(body, chat, salt, "render", exc)

    def of_body(self, body: dict[str, Any], chat: bool, count_fallback: bool = True) -> Features:
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        if self._requests is None:
            features = self._without_tokenizer(body, chat, salt)
            if not features.exact and self.tokenizer_issue is not None and count_fallback:
                self._count_fallback("tokenizer_class")
            return features
        # keyed by the request's rendering inputs, so repeats skip the template and tokenizer
        try:
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError):
            canonical = ""
        key = (hash(canonical), len(canonical), chat)
        cached = self._cached(key) if canonical else None
        if cached is not None:
            return cached
        try:
            ids = self._requests.chat_ids(body) if chat else self._requests.completion_ids(body)
        except TemplateUnrenderable as exc:
            return self._fallback(body, chat, salt, "unsupported" if count_fallback else None, exc)
        except Exception as exc:  # a tokenizer or template bug must never fail the request
            return self._fallback(body, chat, salt, "error" if count_fallback else None, exc)
        features = self.of_tokens(ids, salt, self.adapter_of(body))
        return self._remember(key, features) if canonical else features

    def _count_fallback(self, reason: str) -> None:
        if self._on_fallback is not None:
            self._on_fallback(reason)

    def _cached(self, key: tuple[int, int, object]) -> Features | None:
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
        return cached

    def _remember(self, key: tuple[int, int, object], features: Features) -> Features:
        self._cache[key] = features
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return features

    def _fallback(
        self, body: dict[str, Any], chat: bool, salt: str | None, reason: str | None, exc: Exception
    ) -> Features:
        log.debug("approximate tokenization (%s): %s", reason, exc)
        if reason is not None:
            self._count_fallback(reason)
        return self.approximate(prompt_text(body, chat), salt, self.adapter_of(body))

    def _without_tokenizer(self, body: dict[str, Any], chat: bool, salt: str | None) -> Features:
        adapter = self.adapter_of(body)
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, int):
                return self.of_tokens(prompt, salt, adapter)
            if isinstance(first, list):
                return self.of_tokens(first, salt, adapter)
        text = prompt_text(body, chat)
        key = (hash(text), len(text), (salt, adapter))
        cached = self._cached(key)
        if cached is not None:
            return cached
        if self._fallback_ids:
            return self._remember(key, self.of_tokens(fallback_token_ids(text), salt, adapter))
        return self._remember(key, self.approximate(text, salt, adapter))

    def of_tokens(
        self, token_ids: list[int], salt: str | None = None, adapter: str | None = None
    ) -> Features:
        try:
            keys = block_keys(token_ids, self.block_size, chain_seed(salt, adapter))
        except (OverflowError, TypeError):
            return Features(len(token_ids), [], True, adapter=adapter)
        first = stable_first_block_key(token_ids, self.block_size, salt, adapter)
        return Features(len(token_ids), keys, True, first, adapter)

    def approximate(
        self, text: str, salt: str | None = None, adapter: str | None = None
    ) -> Features:
        prefix = "" if salt is None else f"\x00{salt}\x00"
        if adapter is not None:
            prefix = f"\x01{adapter}\x00{prefix}"
        chars_per_block = CHARS_PER_TOKEN * self.block_size
        keys = text_block_keys(prefix + text, chars_per_block)
        first = stable_text_key(text, chars_per_block, salt, adapter)
        return Features(len(text) // CHARS_PER_TOKEN, keys, False, first, adapter)


def featurizer_of(config: RouterConfig, metrics: RouterMetrics) -> Featurizer:
    """The router's featurizer; requests it cannot tokenize exactly count in the metrics. The
    renderer gets the engines' key, as the engines do."""
    engine_key = EngineKey.from_config(config)
    auth = engine_key.header if engine_key else None
    return Featurizer(
        config.block_size,
        config.tokenizer,
        chat_template=config.chat_template,
        chat_template_kwargs=config.chat_template_kwargs,
        on_fallback=lambda reason: metrics.tokenize_fallbacks.labels(reason).inc(),
        render=RenderClient(config.render_url, auth=auth) if config.render_url else None,
        render_all=config.render_mode == "remote",
        base_models=frozenset((config.served_model_name,)),
    )


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    """The request's text without a tokenizer: the first prompt, or chat as "role: content" lines."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else ""
    messages = body.get("messages")
    parts = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                str(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        parts.append(f"{message.get('role', 'user')}: {'' if content is None else content}\n")
    if body.get("add_generation_prompt", True) is not False:
        parts.append("assistant:")
    return "".join(parts)
