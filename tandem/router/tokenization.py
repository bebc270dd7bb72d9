"""Prompt token ids of an OpenAI request, as vLLM 0.32 computes them.

Completions (`prompt`): a string is encoded with `add_special_tokens` (default true); token ids
are taken as they are; a batch (list of strings or of id lists) is routed by its first prompt.

Chat (`messages`): the template is the request's `chat_template` (a name among the tokenizer's
named templates, or a template), else the router's `chatTemplate` (vLLM's `--chat-template`),
else the tokenizer's own (see `select_template`). Template kwargs, later ones winning:
the router's `chatTemplateKwargs` (vLLM's `--default-chat-template-kwargs`), `tools`; then the
request's `chat_template_kwargs`; then the request's `add_generation_prompt` (default true),
`continue_final_message` (default false), `documents`, `reasoning_effort` (also
`enable_thinking = reasoning_effort != "none"` unless the request set it) — a value of None or
"auto" never overrides. The render is encoded with `add_special_tokens` (default false for chat:
the template carries BOS itself).

Anything the router cannot reproduce exactly raises `TemplateUnrenderable`; the caller then
routes on the approximation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.common.chat_template import is_template_text
from tandem.router.chat_template import (
    TemplateUnrenderable,
    content_format,
    conversation,
    developer_as_system,
    render,
    select_template,
    tool_schemas,
)
from tandem.router.hf_tokenizer import HfTokenizer

_UNSET = (None, "auto")
# apply_chat_template's own parameters never reach the template.
_APPLY_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    return defaults | {k: v for k, v in overrides.items() if v not in _UNSET}


def load_template_override(value: str | None) -> str | None:
    """vLLM's `--chat-template`: a file path, else the template text itself."""
    if value is None:
        return None
    path = Path(value)
    if "\n" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if not is_template_text(value):
        raise ValueError(f"chat template {value!r} is neither a file nor a template")
    return value


class RequestTokenizer:
    """Token ids of completion and chat request bodies for one model's tokenizer."""

    def __init__(
        self,
        tokenizer: HfTokenizer,
        chat_template: str | None = None,
        default_kwargs: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.default_kwargs = dict(default_kwargs or {})

    def completion_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            raise TemplateUnrenderable("prompt is neither text nor token ids")
        return self.tokenizer.encode(prompt, _flag(body, "add_special_tokens", True))

    def chat_text(self, body: dict[str, Any]) -> str:
        tools = tool_schemas(body.get("tools"))
        requested = body.get("chat_template")
        if requested is not None and not isinstance(requested, str):
            raise TemplateUnrenderable("chat_template is not a string")
        source = select_template(
            self.tokenizer.chat_templates, requested or self.chat_template, tools is not None
        )
        messages = conversation(body.get("messages"), content_format(source))
        if any(m["role"] == "developer" for m in messages) and not (
            '"developer"' in source or "'developer'" in source
        ):
            messages = developer_as_system(messages)
        request_kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(request_kwargs, dict):
            raise TemplateUnrenderable("chat_template_kwargs is not an object")
        reasoning = body.get("reasoning_effort")
        explicit = {
            "add_generation_prompt": _flag(body, "add_generation_prompt", True),
            "continue_final_message": _flag(body, "continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": reasoning,
        }
        if reasoning is not None and "enable_thinking" not in request_kwargs:
            explicit["enable_thinking"] = reasoning != "none"
        kwargs = _merge(
            _merge(self.default_kwargs, {"tools": tools}), _merge(request_kwargs, explicit)
        )
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
        continue_final = bool(kwargs.pop("continue_final_message", False))
        if add_generation_prompt and continue_final:
            raise TemplateUnrenderable("continue_final_message with add_generation_prompt")
        context: dict[str, Any] = dict(self.tokenizer.special_tokens)
        context.update((k, v) for k, v in kwargs.items() if k not in _APPLY_PARAMS)
        context["tools"] = kwargs.get("tools")
        context["documents"] = kwargs.get("documents")
        return render(source, messages, context, add_generation_prompt, continue_final)

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        return self.tokenizer.encode(self.chat_text(body), _flag(body, "add_special_tokens", False))


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise TemplateUnrenderable(f"{key} is not a boolean")
    return value
