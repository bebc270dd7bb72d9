"""Chat-template semantics, request tokenization and the featurizer's fallback (no vLLM needed;
the parity with real vLLM is test_router_tokenization_corpus.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from tandem.router import chat_template
from tandem.router.blocks import block_keys
from tandem.router.chat_template import (
    ContentFormat,
    TemplateUnrenderable,
    content_format,
    conversation,
)
from tandem.router.features import Featurizer
from tandem.router.hf_tokenizer import HfTokenizer
from tandem.router.tokenization import RequestTokenizer, load_template_override

FIXTURES = Path(__file__).parent / "fixtures" / "tokenization"
MODELS = FIXTURES / "models"
GOLDEN_TOKENIZER = MODELS / "llama3.1"
# what each corpus template must keep exercising (fixtures/tokenization/README.md) and the
# content format vLLM detects for it
TEMPLATE_FEATURES: dict[str, tuple[ContentFormat, list[str]]] = {
    "llama3_json_tools": (
        "openai",
        ["{%- macro", "raise_exception(", "strftime_now(", "tojson(indent=4)"],
    ),
    "qwen3_xml_tools": (
        "string",
        ["loop.previtem", "loop.nextitem", "| items", "{%- generation", '"developer"'],
    ),
    "gemma3_pythonic_tools": ("openai", ["namespace(", "is boolean", "raise_exception("]),
    "deepseek_v3_tools": ("string", ["namespace(", ".replace("]),
    "phi4_mini_tools": ("string", ['map(attribute="function")']),
    "mistral_parallel_tools": ("string", ["loop.cycle(", "raise_exception("]),
    "chatml": ("string", ["{%- generation"]),
    "hermes_tool_use": ("string", ["{%- continue", "{%- generation"]),
}
# model directory -> the template its tokenizer_config.json carries as a string
SHIPPED = {
    "llama3.1": "llama3_json_tools",
    "gemma3": "gemma3_pythonic_tools",
    "deepseek-v3": "deepseek_v3_tools",
    "phi4-mini": "phi4_mini_tools",
    "mistral": "mistral_parallel_tools",
}


def _render(source: str, messages: list[dict[str, Any]], **context: Any) -> str:
    return chat_template.render(source, messages, context, True, False)


@pytest.mark.parametrize("name", list(TEMPLATE_FEATURES))
def test_corpus_templates_exercise_their_features(name: str) -> None:
    source = (FIXTURES / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
    expected_format, snippets = TEMPLATE_FEATURES[name]
    assert [s for s in snippets if s not in source] == []
    assert content_format(source) == expected_format
    chat_template.compile_template(source)


def test_model_directories_ship_the_templates_as_committed() -> None:
    """The recorded ids belong to these texts: a template edited without re-recording fails."""

    def template(name: str) -> str:
        return (FIXTURES / "templates" / f"{name}.jinja").read_text(encoding="utf-8")

    for model, name in SHIPPED.items():
        assert HfTokenizer.from_directory(MODELS / model).chat_templates == template(name), model
    assert HfTokenizer.from_directory(MODELS / "qwen3").chat_templates == template(
        "qwen3_xml_tools"
    )
    assert HfTokenizer.from_directory(MODELS / "chatml-hermes").chat_templates == {
        "default": template("chatml"),
        "tool_use": template("hermes_tool_use"),
    }
    assert (MODELS / "qwen3" / "chat_template.jinja").is_file()


def test_environment_trims_blocks_and_offers_transformers_helpers() -> None:
    source = (
        "{% for m in messages %}\n  {{ m.content | tojson }}\n{% endfor %}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    out = _render(source, [{"role": "user", "content": "é <b>&"}])
    # tojson keeps non-ASCII and HTML characters; trim_blocks/lstrip_blocks drop the tag lines
    assert out == '  "é <b>&"\n014'
    with pytest.raises(TemplateUnrenderable, match="no system"):
        _render("{{ raise_exception('no system') }}", [{"role": "user", "content": ""}])


def test_generation_tag_renders_its_body() -> None:
    source = (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert _render(source, [{"role": "assistant", "content": "x"}]) == "[x]"


def test_tojson_options_follow_json_dumps() -> None:
    out = _render("{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=true) }}", [{}])
    assert out == json.dumps({"b": 1, "a": [1, 2]}, indent=2, sort_keys=True)


def test_content_format_detection() -> None:
    assert content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert (
        content_format(
            "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
        )
        == "openai"
    )
    # through an alias of messages and a macro parameter
    assert (
        content_format(
            "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% set rest = messages[1:] %}{% for m in rest %}{{ show(m.content) }}{% endfor %}"
        )
        == "openai"
    )


def test_conversation_joins_text_parts_for_string_templates() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
    ]
    as_string = conversation(messages, "string")
    assert as_string[0] == {"role": "user", "content": "a\nb"}
    assert as_string[1]["content"] == ""
    assert as_string[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert as_string[2] == {"role": "tool", "content": "ok", "tool_call_id": "c1"}
    as_parts = conversation(messages, "openai")
    assert as_parts[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert as_parts[1]["content"] == []
    assert as_parts[2]["content"] == "ok"  # tool messages always get a string


def test_text_parts_keep_unknown_fields_in_openai_format() -> None:
    part = {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}
    refusal = {"type": "refusal", "refusal": "no"}
    messages = [{"role": "user", "content": [part, refusal, {"type": "text", "text": None}]}]
    assert conversation(messages, "openai")[0]["content"] == [
        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "no"},
    ]
    assert conversation(messages, "string")[0]["content"] == "a\nno"
    with pytest.raises(TemplateUnrenderable):
        conversation(
            [{"role": "user", "content": [{"type": "text", "text": "a", "uuid": "u"}]}], "string"
        )


def test_conversation_declines_media_and_coerces_bad_arguments() -> None:
    with pytest.raises(TemplateUnrenderable):
        conversation(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "string",
        )
    bad = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "not json"}}
            ],
        }
    ]
    assert conversation(bad, "string")[0]["tool_calls"][0]["function"]["arguments"] == {}
    empty = [{"role": "assistant", "content": "x", "tool_calls": []}]
    assert "tool_calls" not in conversation(empty, "string")[0]


def test_developer_messages_merge_into_one_system_message() -> None:
    merged = chat_template.developer_as_system(
        [
            {"role": "system", "content": "A"},
            {"role": "user", "content": "q"},
            {"role": "developer", "content": "B", "tools": None},
        ]
    )
    assert merged == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "q"}]


def test_tool_schemas_keep_vllm_fields_only() -> None:
    tools = chat_template.tool_schemas(
        [{"type": "function", "extra": 1, "function": {"name": "f", "parameters": {}, "x": 2}}]
    )
    assert tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {}}}
    ]
    with pytest.raises(TemplateUnrenderable):
        chat_template.tool_schemas([])


def test_named_template_selection() -> None:
    named = {"default": "D", "tool_use": "T"}
    assert chat_template.select_template(named, None, has_tools=False) == "D"
    assert chat_template.select_template(named, None, has_tools=True) == "T"
    assert chat_template.select_template(named, "tool_use", has_tools=False) == "T"
    assert chat_template.select_template(named, "{{ x }}", has_tools=False) == "{{ x }}"
    assert chat_template.select_template("S", None, has_tools=True) == "S"
    with pytest.raises(TemplateUnrenderable):
        chat_template.select_template({"other": "O"}, None, has_tools=False)


def test_continue_final_message_cuts_at_the_final_content() -> None:
    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer"}]
    assert (
        chat_template.render(source, messages, {}, False, True)
        == "<user>q</user><assistant>The answer"
    )
    trimming = "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}"
    assert chat_template.render(trimming, messages, {}, False, True) == "[q][The answer"


def test_request_tokenizer_rules(tmp_path: Path) -> None:
    tokenizer = HfTokenizer.from_directory(GOLDEN_TOKENIZER)
    assert tokenizer.special_tokens["bos_token"] == "<|begin_of_text|>"
    bos = tokenizer.backend.token_to_id("<|begin_of_text|>")
    requests = RequestTokenizer(tokenizer, default_kwargs={"date_string": "1 Jan 2000"})
    text = requests.chat_text({"messages": [{"role": "user", "content": "hi"}]})
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today Date: 1 Jan 2000" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # request kwargs beat the router's defaults; explicit request fields beat request kwargs
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"date_string": "2 Feb 2002", "add_generation_prompt": True},
        "add_generation_prompt": False,
    }
    text = requests.chat_text(body)
    assert "2 Feb 2002" in text
    assert not text.endswith("\n\n")
    ids = requests.chat_ids({"messages": [{"role": "user", "content": "hi"}]})
    assert ids[0] == bos
    assert ids[1] != bos
    twice = requests.chat_ids(
        {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}
    )
    assert twice[:2] == [bos, bos]
    assert requests.completion_ids({"prompt": "hi"})[0] == bos
    assert requests.completion_ids({"prompt": "hi", "add_special_tokens": False})[0] != bos
    assert requests.completion_ids({"prompt": [[5, 6, 7], [8]]}) == [5, 6, 7]
    with pytest.raises(TemplateUnrenderable):
        requests.chat_ids(
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}
        )


def test_tokenizer_adds_missing_special_tokens_and_reads_template_files(tmp_path: Path) -> None:
    base = json.loads((GOLDEN_TOKENIZER / "tokenizer.json").read_text())
    base["added_tokens"] = [t for t in base["added_tokens"] if t["content"] != "<|python_tag|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(base))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|begin_of_text|>"},
                "eos_token": "<new_eos>",
                "chat_template": "ignored",
            }
        )
    )
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    tokenizer = HfTokenizer.from_directory(tmp_path)
    assert tokenizer.chat_templates == "{{ eos_token }}"
    new_id = tokenizer.backend.token_to_id("<new_eos>")
    assert new_id == Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size(True)
    assert tokenizer.encode("a<new_eos>", add_special_tokens=False)[-1] == new_id
    extra = tmp_path / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("T")
    assert HfTokenizer.from_directory(tmp_path).chat_templates == {
        "default": "{{ eos_token }}",
        "tool_use": "T",
    }


def test_template_override_is_a_file_or_text(tmp_path: Path) -> None:
    file = tmp_path / "t.jinja"
    file.write_text("{{ 1 }}")
    assert load_template_override(str(file)) == "{{ 1 }}"
    assert load_template_override("{{ 2 }}") == "{{ 2 }}"
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_template_override("no-such-template")


def test_featurizer_falls_back_and_counts_unrenderable_requests() -> None:
    reasons: list[str] = []
    featurizer = Featurizer(16, str(GOLDEN_TOKENIZER), on_fallback=reasons.append)
    image = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
        ]
    }
    features = featurizer.of_body(image, chat=True)
    assert not features.exact
    assert reasons == ["unsupported"]
    # a template that raises (Llama 3.1 refuses two tool calls at once) is no 500 either
    two_calls = {
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
                * 2,
            },
        ]
    }
    assert not featurizer.of_body(two_calls, chat=True).exact
    assert reasons == ["unsupported", "unsupported"]
    plain = featurizer.of_body({"prompt": "hello " * 40, "cache_salt": "s"}, chat=False)
    assert plain.exact
    assert plain.keys[0] != featurizer.of_body({"prompt": "hello " * 40}, False).keys[0]
    ids = RequestTokenizer(HfTokenizer.from_directory(GOLDEN_TOKENIZER)).completion_ids(
        {"prompt": "hello " * 40}
    )
    assert featurizer.of_body({"prompt": "hello " * 40}, False).keys == block_keys(ids, 16)


def test_documents_reasoning_effort_and_template_kwargs_reach_the_template() -> None:
    tokenizer = HfTokenizer.from_directory(GOLDEN_TOKENIZER)
    source = (
        "{{ documents | map(attribute='title') | join(',') }}|{{ enable_thinking }}|"
        "{{ reasoning_effort }}|{{ custom }}|{{ tools | length }}"
    )
    requests = RequestTokenizer(tokenizer, chat_template=source, default_kwargs={"custom": "d"})
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "x"}],
        "documents": [{"title": "a", "text": "1"}, {"title": "b", "text": "2"}],
        "reasoning_effort": "none",
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    assert requests.chat_text(body) == "a,b|False|none|d|1"
    body["chat_template_kwargs"] = {"custom": "r", "enable_thinking": True}
    assert requests.chat_text(body) == "a,b|True|none|r|1"
