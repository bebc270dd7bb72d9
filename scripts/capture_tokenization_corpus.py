"""Record the tokenization parity corpus from real vLLM 0.32 (CPU build, no engine needed).

    flock /tmp/tandem-realvllm.lock unshare --net bash -c 'ip link set lo up &&
        exec "$0" scripts/capture_tokenization_corpus.py "$@"' "$(scripts/ensure-vllm.sh | tail -1)"

(a network namespace of its own: the renderer reaches nothing but 127.0.0.1)

1. Builds one small tokenizer per chat template under tests/router/fixtures/tokenization/models/:
   the test model's byte-level BPE (tests/fixtures/vllm-0.32/model/tokenizer.json) plus the
   template's special tokens, with bos/eos/pad as the template's model family sets them and the
   template stored the way that family ships it (tokenizer_config.json string, a list of named
   templates, or chat_template.jinja).
2. Starts vLLM's GPU-less renderer (`vllm launch render`, the same preprocessing code as
   `vllm serve`) on each model, two at a time, with `--trust-request-chat-template` and
   `--default-chat-template-kwargs` (a fixed `date_string`, so the Llama template does not depend
   on today's date), and records its `/tokenize` answer (ids, or the error status) for every
   conversation and completion case into tests/router/fixtures/tokenization/corpus.json.
tests/router/test_router_tokenization_corpus.py replays the corpus against the router.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/router/fixtures/tokenization"
GOLDEN = ROOT / "tests" / "fixtures" / "vllm-0.32" / "model"
DEFAULT_KWARGS = {"date_string": "26 Jul 2024"}


def _deepseek(words: str) -> str:
    """DeepSeek's special tokens: full-width bars around words joined by U+2581."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


# name -> template file, how it is shipped, special tokens, named tokens, bos post-processor
MODELS: dict[str, dict] = {
    "llama3.1": {
        "template": "llama3_json_tools",
        "ship": "config",
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "named": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "bos_post_processor": True,
    },
    "qwen3": {
        "template": "qwen3_xml_tools",
        "ship": "jinja_file",
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        "named": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "bos_post_processor": False,
    },
    "gemma3": {
        "template": "gemma3_pythonic_tools",
        "ship": "config",
        "special": [
            "<pad>",
            "<eos>",
            "<bos>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<start_of_image>",
        ],
        "named": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        # add_bos_token in the config, no post-processor in tokenizer.json
        "config_extra": {"add_bos_token": True},
        "bos_post_processor": False,
    },
    "deepseek-v3": {
        "template": "deepseek_v3_tools",
        "ship": "config",
        "special": [
            _deepseek("begin of sentence"),
            _deepseek("end of sentence"),
            _deepseek("User"),
            _deepseek("Assistant"),
            _deepseek("tool calls begin"),
            _deepseek("tool calls end"),
            _deepseek("tool call begin"),
            _deepseek("tool call end"),
            _deepseek("tool sep"),
            _deepseek("tool outputs begin"),
            _deepseek("tool outputs end"),
            _deepseek("tool output begin"),
            _deepseek("tool output end"),
        ],
        # AddedToken dicts, as DeepSeek's tokenizer_config.json writes them
        "named": {
            "bos_token": {
                "__type": "AddedToken",
                "content": _deepseek("begin of sentence"),
                "lstrip": False,
                "normalized": True,
                "rstrip": False,
                "single_word": False,
            },
            "eos_token": {
                "__type": "AddedToken",
                "content": _deepseek("end of sentence"),
                "lstrip": False,
                "normalized": True,
                "rstrip": False,
                "single_word": False,
            },
        },
        "bos_post_processor": True,
    },
    "phi4-mini": {
        "template": "phi4_mini_tools",
        "ship": "config",
        "special": [
            "<|endoftext|>",
            "<|system|>",
            "<|end|>",
            "<|user|>",
            "<|assistant|>",
            "<|tool|>",
            "<|tool_call|>",
        ],
        "named": {
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
        },
        "bos_post_processor": False,
    },
    "mistral": {
        "template": "mistral_parallel_tools",
        "ship": "config",
        "special": [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "named": {"bos_token": "<s>", "eos_token": "</s>"},
        "bos_post_processor": True,
    },
    "chatml-hermes": {
        "template": {"default": "chatml", "tool_use": "hermes_tool_use"},
        "ship": "named_list",
        "special": ["<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        "named": {"bos_token": "<s>", "eos_token": "<|im_end|>"},
        "bos_post_processor": False,
    },
}


def build_models() -> None:
    base = json.loads((GOLDEN / "tokenizer.json").read_text())
    config = json.loads((GOLDEN / "config.json").read_text())
    templates = FIXTURES / "templates"
    for name, spec in MODELS.items():
        out = FIXTURES / "models" / name
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.iterdir():
            stale.unlink()
        tok = json.loads(json.dumps(base))
        next_id = max(t["id"] for t in tok["added_tokens"]) + 1
        next_id = max(next_id, len(tok["model"]["vocab"]))
        present = {t["content"]: t["id"] for t in tok["added_tokens"]}
        for content, special in [(c, True) for c in spec["special"]] + [
            (c, False) for c in spec.get("added", [])
        ]:
            if content in present:
                continue
            tok["added_tokens"].append(
                {
                    "id": next_id,
                    "content": content,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": special,
                }
            )
            present[content] = next_id
            next_id += 1
        if spec["bos_post_processor"]:
            named = spec["named"]["bos_token"]
            bos = named if isinstance(named, str) else named["content"]
            tok["post_processor"] = {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": bos, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                ],
                "pair": [
                    {"SpecialToken": {"id": bos, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"SpecialToken": {"id": bos, "type_id": 1}},
                    {"Sequence": {"id": "B", "type_id": 1}},
                ],
                "special_tokens": {bos: {"id": bos, "ids": [present[bos]], "tokens": [bos]}},
            }
        (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=1))
        (out / "config.json").write_text(json.dumps(config, indent=1))
        tconf = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 2048,
            **spec["named"],
            **spec.get("config_extra", {}),
        }
        template = spec["template"]
        if spec["ship"] == "named_list":
            tconf["chat_template"] = [
                {"name": k, "template": (templates / f"{v}.jinja").read_text()}
                for k, v in template.items()
            ]
        elif spec["ship"] == "jinja_file":
            (out / "chat_template.jinja").write_text((templates / f"{template}.jinja").read_text())
        else:
            tconf["chat_template"] = (templates / f"{template}.jinja").read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(tconf, ensure_ascii=False, indent=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, path: str, body: dict) -> tuple[int, object]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def start(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.render.entry",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "m",
            "--trust-request-chat-template",
            "--default-chat-template-kwargs",
            json.dumps(DEFAULT_KWARGS),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def wait_ready(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"renderer exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("renderer did not start")


def capture(name: str, port: int, cases: list[dict]) -> list[dict]:
    records = []
    for case in cases:
        status, answer = post(port, "/tokenize", {"model": "m", **case["request"]})
        ids = answer.get("tokens") if status == 200 and isinstance(answer, dict) else None
        records.append(
            {
                "model": name,
                "case": case["name"],
                "kind": case["kind"],
                "request": case["request"],
                "status": status,
                "ids": ids,
            }
        )
    return records


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests/router"))
    from tokenization_cases import chat_cases, completion_cases

    build_models()
    cases = chat_cases() + completion_cases()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "tandem-tokenization-capture"
    logs.mkdir(exist_ok=True)
    names = list(MODELS)
    records: list[dict] = []
    for i in range(0, len(names), 2):  # at most two renderers at once
        running = []
        for name in names[i : i + 2]:
            port = free_port()
            log = logs / f"{name}.log"
            running.append((name, port, start(FIXTURES / "models" / name, port, log), log))
        try:
            for name, port, proc, log in running:
                wait_ready(port, proc, log)
                records += capture(name, port, cases)
                print(
                    name,
                    sum(r["status"] == 200 for r in records if r["model"] == name),
                    "ok of",
                    len(cases),
                    flush=True,
                )
        finally:
            for _, _, proc, _ in running:
                proc.terminate()
                proc.wait(30)
    (FIXTURES / "corpus.json").write_text(
        json.dumps(
            {"vllm": "0.32.0", "default_chat_template_kwargs": DEFAULT_KWARGS, "records": records},
            ensure_ascii=False,
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
