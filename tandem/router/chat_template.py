"""Chat templates rendered with the semantics vLLM 0.32 uses (transformers' `apply_chat_template`).

Environment: jinja2's `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
the `loopcontrols` extension and a `{% generation %}` block tag that renders its body;
`raise_exception(msg)` raises a TemplateError, `strftime_now(fmt)` formats the local time, and
`tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` is `json.dumps`
with those defaults (no HTML escaping, unlike jinja's own filter).

Context of one render: the tokenizer's named special tokens (`bos_token`, `eos_token`, ...), then
the request's template kwargs (they override special tokens), `messages`, `tools`, `documents`,
`add_generation_prompt`.

`continue_final_message`: the last message's content (the last text part when it is a list) gets
the tag `"CONTINUE_FINAL_MESSAGE_TAG "` appended; the render is cut where the tag starts (and
right-stripped when the template trimmed the tag's trailing space).

Content format (vLLM's detection): a template that loops over a message's `content` (directly,
through a variable assigned from `messages`, or through a macro parameter that receives it) gets
content parts as a list of dicts (`"openai"`); any other template gets one string, the text
parts joined by `"\\n"` (`"string"`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateUnrenderable(Exception):
    """The router cannot render this request exactly as the engine would."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


# -- content format detection -------------------------------------------------------------------


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` reads variable `name` (or its `key` item), possibly filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        inner, matches = (
            node.node,
            isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key,
        )
    elif isinstance(node, jinja2.nodes.Getattr):
        inner, matches = node.node, node.attr == key
    else:
        return False
    return matches and _reads(inner, name)


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """`name` and every variable assigned from it (transitively)."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and _reads(assign.node, current)
                and target.name not in found
            ):
                found.append(target.name)
                queue.append(target.name)
    return found


def _loop_targets(root: jinja2.nodes.Template, sources: list[str]) -> list[str]:
    return [
        loop.target.name
        for loop in root.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, s) for s in sources)
    ]


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    message_vars = _loop_targets(root, _aliases(root, "messages"))
    macro_loops: dict[int, set[str]] = {}  # loop id -> macro params that receive a content
    for macro in root.find_all(jinja2.nodes.Macro):
        names = [a.name for a in macro.args]
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args[: len(names)]):
                if any(_reads(arg, m, "content") for m in message_vars):
                    params.add(names[i])
            for kw in call.kwargs:
                if kw.key in names and any(_reads(kw.value, m, "content") for m in message_vars):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            macro_loops[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_reads(it, m, "content") for m in message_vars):
            yield loop
        elif isinstance(it, jinja2.nodes.Name):
            receivers = macro_loops.get(id(loop))  # None: the loop is outside every macro
            if (receivers is not None and it.name in receivers) or (
                receivers is None and it.name == "content"
            ):
                yield loop


@lru_cache(maxsize=64)
def content_format(source: str) -> ContentFormat:
    """ "openai" when the template iterates over a message's content parts, else "string"."""
    try:
        root = _ENV.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    return "openai" if next(_content_loops(root), None) is not None else "string"


# -- messages as the template sees them ------------------------------------------------------

_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text"}
_TEXT_KEYS |= {"refusal": "refusal", "thinking": "thinking"}
# Fields of vLLM's content-part schemas; any other key of a text part rides along in "openai"
# format (e.g. a client's `cache_control`).
_KNOWN_PART_FIELDS = frozenset(
    {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil"}
    | {"image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text"}
    | {"thinking", "type", "uuid", "video_embeds", "video_url"}
)


def _text_parts(content: Any) -> list[dict[str, Any]]:
    """Content as `{"type": "text", "text": ..., <extra keys>}` parts (vLLM skips text parts whose
    text is null; it refuses parts with a `uuid` and renders media, which the router declines)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise TemplateUnrenderable("content is neither a string nor a list of parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None or part.get("uuid") is not None:
            raise TemplateUnrenderable(f"content part of type {kind!r}")
        text = part.get(key)
        if text is None:
            continue
        if not isinstance(text, str):
            raise TemplateUnrenderable("content part text is not a string")
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        parts.append({"type": "text", "text": text, **extra})
    return parts


def _tool_call_arguments(arguments: Any) -> Any:
    """vLLM hands templates the arguments as a dict: JSON strings parsed, anything else -> {}."""
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def conversation(messages: Any, fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages a template receives for the request's `messages` (text content only).

    Per message: `role`, `content` (string format: the text parts joined by "\\n", "" when
    absent; openai format: a list of `{"type": "text", "text": ...}`; tool messages always get
    a string), then `tool_calls` (assistant: arguments as dicts, an empty list dropped),
    `reasoning` and `reasoning_content`, `tool_call_id` (tool), `name`.
    """
    if not isinstance(messages, list) or not messages:
        raise TemplateUnrenderable("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TemplateUnrenderable("a message without a role")
        role = message["role"]
        parts = _text_parts(message.get("content"))
        entry: dict[str, Any] = {"role": role}
        if role == "tool" or fmt == "string":
            entry["content"] = "\n".join(p["text"] for p in parts)
        else:
            entry["content"] = parts
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise TemplateUnrenderable("tool_calls is not a list")
                if calls:
                    entry["tool_calls"] = [_tool_call(c) for c in calls]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                entry["reasoning"] = entry["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            entry["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if role == "developer":
            entry["tools"] = message.get("tools")
        out.append(entry)
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    """A tool call as vLLM's request validation leaves it: the OpenAI schema's key order
    (`id`, `function` {`arguments`, `name`}, `type`), unknown keys dropped, arguments a dict."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise TemplateUnrenderable("tool call that is not a function call")
    out: dict[str, Any] = {"id": call["id"]} if "id" in call else {}
    out["function"] = {"arguments": _tool_call_arguments(function.get("arguments"))}
    if "name" in function:
        out["function"]["name"] = function["name"]
    if "type" in call:
        out["type"] = call["type"]
    return out


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that never mention "developer": developer messages become system ones, and
    all system messages merge into the first position ("\\n\\n" between them) when any is not
    already first."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(systems)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


def tool_schemas(tools: Any) -> list[dict[str, Any]] | None:
    """Request tools as vLLM passes them: `{"type", "function": {"name", "description",
    "parameters"[, "strict"][, "defer_loading"]}}` with unknown keys dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise TemplateUnrenderable("tools must be a non-empty list")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TemplateUnrenderable("a tool without a function name")
        defer = tool.get("defer_loading")
        schema: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            schema["strict"] = function["strict"]
        fn_defer = function.get("defer_loading", defer)
        if fn_defer is not None:
            schema["defer_loading"] = fn_defer
        entry: dict[str, Any] = {"type": "function", "function": schema}
        if defer is not None:
            entry["defer_loading"] = defer
        out.append(entry)
    return out


# -- rendering -------------------------------------------------------------------------------


def select_template(
    templates: str | dict[str, str] | None, requested: str | None, has_tools: bool
) -> str:
    """The template source (transformers' `get_chat_template`): a requested name picks from the
    named templates, any other requested string is the template itself; without one, named
    templates give "tool_use" when tools are present, else "default"."""
    if isinstance(templates, dict):
        if requested is not None:
            return templates.get(requested, requested)
        if has_tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise TemplateUnrenderable("several chat templates and none is the default")
    if requested is not None:
        return requested
    if templates is None:
        raise TemplateUnrenderable("the tokenizer has no chat template")
    return templates


def render(
    source: str,
    messages: list[dict[str, Any]],
    context: dict[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    """Render `messages` with `source`; `context` holds special tokens, tools, documents, kwargs."""
    if continue_final_message:
        messages = _tag_final_message(messages, source)
    try:
        text = compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )
    except Exception as exc:  # a template may raise anything; the engine answers 400
        raise TemplateUnrenderable(f"template error: {exc}") from exc
    return _cut_at_tag(text, messages) if continue_final_message else text


def _tag_final_message(messages: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    last = dict(messages[-1])
    content = last.get("content")
    if content is None or "content" not in source:
        raise TemplateUnrenderable("continue_final_message without a content to continue")
    if isinstance(content, list | tuple):
        parts = [dict(p) for p in content]
        for part in reversed(parts):
            if "text" in part:
                part["text"] = part["text"] + CONTINUE_TAG
                break
        else:
            raise TemplateUnrenderable("continue_final_message without a text part")
        last["content"] = parts
    else:
        last["content"] = content + CONTINUE_TAG
    return [*messages[:-1], last]


def _cut_at_tag(text: str, messages: list[dict[str, Any]]) -> str:
    content = messages[-1]["content"]
    if isinstance(content, list):
        final = next(p["text"] for p in reversed(content) if "text" in p)
    else:
        final = content
    final = final[: -len(CONTINUE_TAG)]
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TemplateUnrenderable("the template dropped part of the final message")
    at = text.rindex(tag)
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
