"""The conversations and completion prompts of the tokenization parity corpus.

Shared by scripts/capture_tokenization_corpus.py (which records real vLLM's ids for them) and
the replay test; every case runs against every template of the corpus.
"""

from __future__ import annotations

from typing import Any

SYSTEM = "You are a concise assistant. Answer in one sentence."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
TOOL_CALL = {
    "id": "call0abcdefgh1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'},
}

OSLO_CALL = {
    "id": "call1ijklmnop2",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
# every JSON kind once: a template's value rendering (Python literals, XML, JSON) meets them all
NESTED_ARGUMENTS = (
    '{"city": "Oslo", "days": 3, "hourly": true, "fields": ["temp", "wind"],'
    ' "where": {"lat": 59.9, "lon": 10.75}, "note": null}'
)


def _chat(name: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": name, "kind": "chat", "request": {"messages": messages, **extra}}


def chat_cases() -> list[dict[str, Any]]:
    user = {"role": "user", "content": "What is the capital of France?"}
    answer = {"role": "assistant", "content": "Paris."}
    follow = {"role": "user", "content": "And of Italy?"}
    return [
        _chat("user_only", [user]),
        _chat("system_multi_turn", [{"role": "system", "content": SYSTEM}, user, answer, follow]),
        _chat("no_generation_prompt", [user, answer], add_generation_prompt=False),
        _chat(
            "continue_final_message",
            [user, {"role": "assistant", "content": "The capital is "}],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        _chat(
            "unicode",
            [
                {"role": "system", "content": "Réponds en français. 日本語も可。"},
                {"role": "user", "content": "Grüße! 🚀 naïve café — ½ · 世界 \u00a0tab\there"},
            ],
        ),
        _chat(
            "content_parts",
            [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "First part."},
                        {"type": "text", "text": "Second part."},
                    ],
                },
            ],
        ),
        _chat(
            # a template that loops over the parts trims each one; a string template gets them
            # joined first, so the content format vLLM detects shows in the ids
            "padded_content_parts",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "  First part. "},
                        {"type": "text", "text": " Second part.  "},
                    ],
                }
            ],
        ),
        _chat("tools", [user], tools=[WEATHER_TOOL]),
        _chat(
            "tool_calls",
            [
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {
                    "role": "tool",
                    "tool_call_id": TOOL_CALL["id"],
                    "name": "get_weather",
                    "content": '{"temp": 21}',
                },
            ],
            tools=[WEATHER_TOOL],
        ),
        _chat("developer_role", [{"role": "developer", "content": SYSTEM}, user]),
        _chat("add_special_tokens", [user], add_special_tokens=True),
        _chat(
            "chat_template_kwargs",
            [user],
            chat_template_kwargs={"date_string": "01 Dec 2026", "unused_flag": True},
        ),
        _chat(
            "request_chat_template",
            [user, answer, follow],
            chat_template=(
                "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}"
                "{% if not loop.last %}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}\n<assistant>{% endif %}"
            ),
        ),
        _chat(
            "content_part_kinds",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Cached part.", "cache_control": {"type": "x"}},
                        {"type": "input_text", "text": "Input text part."},
                    ],
                },
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
                follow,
            ],
        ),
        _chat("roles_not_alternating", [user, follow]),
        _chat(
            "two_tool_calls",
            [
                {"role": "user", "content": "Weather in Zürich and Oslo?"},
                {
                    "role": "assistant",
                    "content": "Checking both.",
                    "tool_calls": [TOOL_CALL, OSLO_CALL],
                },
            ],
            tools=[WEATHER_TOOL],
            add_generation_prompt=False,
        ),
        _chat(
            "continue_and_generation_prompt",
            [user, {"role": "assistant", "content": "The capital is "}],
            continue_final_message=True,
        ),
        _chat("named_template_by_request", [user], chat_template="tool_use"),
        _chat(
            "special_text_in_content", [{"role": "user", "content": "say <s> and </s> <|im_end|>"}]
        ),
        _chat(
            "two_tool_results",
            [
                {"role": "user", "content": "Weather in Zürich and Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL, OSLO_CALL]},
                {"role": "tool", "tool_call_id": TOOL_CALL["id"], "content": '{"temp": 21}'},
                {"role": "tool", "tool_call_id": OSLO_CALL["id"], "content": '{"temp": 4}'},
            ],
            tools=[WEATHER_TOOL],
        ),
        _chat(
            "nested_arguments",
            [
                {"role": "user", "content": "Forecast for Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call2qrstuvw3",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": NESTED_ARGUMENTS},
                        }
                    ],
                },
            ],
            tools=[WEATHER_TOOL],
            add_generation_prompt=False,
        ),
        _chat(
            "tools_in_system_turn",
            [user],
            tools=[WEATHER_TOOL],
            chat_template_kwargs={"tools_in_user_message": False},
        ),
        _chat(
            "short_tool_call_id",
            [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [dict(OSLO_CALL, id="c1")]},
            ],
            tools=[WEATHER_TOOL],
            add_generation_prompt=False,
        ),
    ]


def completion_cases() -> list[dict[str, Any]]:
    text = "The quick brown fox jumps over the lazy dog."
    return [
        {"name": "prompt_default", "kind": "completion", "request": {"prompt": text}},
        {
            "name": "prompt_special_tokens_off",
            "kind": "completion",
            "request": {"prompt": text, "add_special_tokens": False},
        },
        {
            "name": "prompt_special_tokens_on",
            "kind": "completion",
            "request": {"prompt": text, "add_special_tokens": True},
        },
        {
            "name": "prompt_with_special_text",
            "kind": "completion",
            "request": {"prompt": "<s>hello</s> world <|im_start|>x"},
        },
    ]
