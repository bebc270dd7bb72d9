"""Record model-specific tokenizer classes' token ids from vLLM 0.32's own tokenizer loading.

    flock /tmp/tandem-realvllm.lock unshare --net bash -c 'ip link set lo up &&
        exec "$0" scripts/capture_tokenizer_classes.py "$@"' "$(scripts/ensure-vllm.sh | tail -1)" [--e2e]

(a network namespace of its own: the renderer reaches nothing but 127.0.0.1)

1. Builds small tokenizer directories under tests/router/fixtures/tokenization/classes/: the
   byte-level BPE of the llama3.1 fixture, and a SentencePiece-style BPE trained here (Metaspace
   normalizer, `<unk>`, byte fallback, BOS post-processor, as Llama-2 / Mistral-v0.1 / Gemma
   files are), each with a `tokenizer_class` and config.json `model_type` set (see VARIANTS).
2. Loads each with `vllm.tokenizers.registry.get_tokenizer` (the loading `vllm serve` does:
   AutoTokenizer through transformers 5.19) and records the class it got and the ids of every
   text of TEXTS (add_special_tokens true and false) and of CHATS rendered with the chatml
   template (`apply_chat_template(tokenize=False)`, then encoded without special tokens).
3. Records which class transformers picks for a grid of model_type x tokenizer_class.
4. With --e2e, starts vLLM's renderer (`vllm launch render`) on two variants and checks its
   `/tokenize` answers equal the recorded ids (stored with the corpus).
tests/router/test_router_tokenizer_classes.py replays classes.json against the router.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/router/fixtures/tokenization"
OUT = FIXTURES / "classes"
BYTE_LEVEL = FIXTURES / "models/llama3.1"
CHATML = (FIXTURES / "templates/chatml.jinja").read_text()

TEXTS = [
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "hello\n\nworld\n",
    "\n\nstarts with newlines",
    "tab\there  and  double  spaces ",
    "trailing space ",
    " ",
    "",
    "naïve café — ½ · Grüße",
    "cafe\u0301 decomposed e\u0301",
    "日本語のテキストと世界",
    "emoji 🙂👍🏽🚀",
    "numbers 1234567 and 3.14159, 2026-12-01",
    "it's can't WE'LL they'd",
    "<s>hello</s> in text",
    "<bos>hi<eos> and <unk> and <pad>",
    "[INST] question [/INST] answer",
    "<|im_start|>user\nhi<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "def f(x):\n    return x ** 2\n",
    "▁already▁metaspace ▁",
    "non\u00a0breaking\u2003em space",
    "windows\r\nline\r\nends",
    "ALL CAPS and MiXeD cAsE",
    "a" * 40,
    "ß ẞ Ω ω ﬁ ligature",
    "👨‍👩‍👧 family zwj",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "  You are terse.\n"},
        {"role": "user", "content": "Grüße 🚀 naïve 123"},
        {"role": "assistant", "content": " Paris."},
        {"role": "user", "content": "<s> and </s> inside"},
    ],
]

SPM_SPECIAL = {
    "llama": ["<unk>", "<s>", "</s>"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
}
SPM_TRAINING = [
    "The quick brown fox jumps over the lazy dog. Hello world! hello there, world.",
    "Question: what is the capital of France? Answer: Paris is the capital.",
    "def function(x):\n    return x ** 2  # squares\nprint(function(3))",
    "user assistant system instruction answer response tokens merges vocabulary",
    "naïve café Grüße 1234567890 it's can't won't they'll",
]

SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # a field written as that file beside the config
# name -> (tokenizer.json source, tokenizer_config.json fields, model_type)
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "bytelevel-llama-class": ("bytelevel", {"tokenizer_class": "LlamaTokenizerFast"}, "llama"),
    "bytelevel-qwen2-class": (
        "bytelevel",
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|eot_id|>"},
        "qwen2",
    ),
    "bytelevel-qwen2-type-generic-class": (
        "bytelevel",
        {"tokenizer_class": "PreTrainedTokenizerFast"},
        "qwen2",
    ),
    "bytelevel-qwen3_5-class": ("bytelevel", {"tokenizer_class": "Qwen3_5Tokenizer"}, "qwen3_5"),
    "bytelevel-gpt2-class": ("bytelevel", {"tokenizer_class": "GPT2Tokenizer"}, "gpt2"),
    "bytelevel-gpt2-prefix-space": (
        "bytelevel",
        {"tokenizer_class": "GPT2TokenizerFast", "add_prefix_space": True},
        "gpt2",
    ),
    "bytelevel-gpt-neox-class": (
        "bytelevel",
        {"tokenizer_class": "GPTNeoXTokenizerFast"},
        "gpt_neox",
    ),
    "bytelevel-cohere-class": (
        "bytelevel",
        {"tokenizer_class": "CohereTokenizerFast", "bos_token": "<|begin_of_text|>"},
        "cohere",
    ),
    "bytelevel-deepseek-v3-llama-class": (
        "bytelevel",
        {"tokenizer_class": "LlamaTokenizerFast"},
        "deepseek_v3",
    ),
    "spm-llama2": (
        "llama",
        {
            "tokenizer_class": "LlamaTokenizer",
            "legacy": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
        },
        "llama",
    ),
    "spm-llama2-hub-files": (
        "llama",
        {
            "tokenizer_class": "LlamaTokenizerFast",
            "legacy": False,
            "add_bos_token": True,
            "added_tokens_decoder": {
                str(i): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, t in enumerate(SPM_SPECIAL["llama"])
            },
            "additional_special_tokens": ["[INST]", "[/INST]"],
            SPECIAL_TOKENS_MAP: {
                "bos_token": {"content": "<s>", "lstrip": False, "normalized": False},
                "eos_token": "</s>",
                "unk_token": "<unk>",
            },
        },
        "llama",
    ),
    "spm-llama2-legacy": (
        "llama",
        {"tokenizer_class": "LlamaTokenizer", "legacy": True, "add_bos_token": True},
        "llama",
    ),
    "spm-llama-no-prefix-space": (
        "llama",
        {"tokenizer_class": "LlamaTokenizerFast", "add_prefix_space": False, "legacy": False},
        "llama",
    ),
    "spm-mistral-v0.1": (
        "llama",
        {"tokenizer_class": "LlamaTokenizer", "legacy": True, "add_bos_token": True},
        "mistral",
    ),
    "spm-gemma": (
        "gemma",
        {
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "add_bos_token": True,
        },
        "gemma",
    ),
    "spm-gemma3": ("gemma", {"tokenizer_class": "GemmaTokenizerFast"}, "gemma3_text"),
    "spm-generic-class": ("llama", {"tokenizer_class": "PreTrainedTokenizerFast"}, "llama"),
}
GRID_TYPES = [
    "llama",
    "mistral",
    "mixtral",
    "gemma",
    "gemma3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "deepseek_v3",
    "phi3",
    "gpt2",
    "phi",
    "granite",
    "olmo2",
    "internlm2",
    "cohere",
]
GRID_CLASSES = [
    "PreTrainedTokenizerFast",
    "LlamaTokenizerFast",
    "LlamaTokenizer",
    "GemmaTokenizerFast",
    "Qwen2Tokenizer",
    "Qwen2TokenizerFast",
    "GPT2Tokenizer",
    "CohereTokenizerFast",
    None,
]


def spm_tokenizer(family: str) -> dict[str, Any]:
    """A SentencePiece-style BPE tokenizer.json: Metaspace normalizer, byte fallback, BOS added."""
    from tokenizers import Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    special = SPM_SPECIAL[family]
    unk = "<unk>"
    bos = special[1] if family == "llama" else "<bos>"
    tokenizer = Tokenizer(BPE(unk_token=unk, byte_fallback=True, fuse_unk=True))
    if family == "llama":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = BpeTrainer(
        vocab_size=len(special) + 256 + 160,
        special_tokens=special + byte_tokens,
        show_progress=False,
    )
    tokenizer.train_from_iterator(SPM_TRAINING * 3, trainer)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if family == "llama" else [])
    )
    bos_id = tokenizer.token_to_id(bos)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    data = json.loads(tokenizer.to_str())
    # byte tokens are vocabulary pieces in real files, not added tokens
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in special]
    return data


def build_variants() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    sources = {
        "bytelevel": json.loads((BYTE_LEVEL / "tokenizer.json").read_text()),
        "llama": spm_tokenizer("llama"),
        "gemma": spm_tokenizer("gemma"),
    }
    base_config = json.loads((BYTE_LEVEL / "config.json").read_text())
    byte_named = json.loads((BYTE_LEVEL / "tokenizer_config.json").read_text())
    for name, (source, fields, model_type) in VARIANTS.items():
        out = OUT / name
        out.mkdir(parents=True)
        (out / "tokenizer.json").write_text(json.dumps(sources[source], ensure_ascii=False))
        config = {k: v for k, v in byte_named.items() if k.endswith("_token")}
        if source != "bytelevel":
            config = {}
        config.update(fields, chat_template=CHATML, model_max_length=4096)
        if SPECIAL_TOKENS_MAP in config:
            special_map = config.pop(SPECIAL_TOKENS_MAP)
            (out / SPECIAL_TOKENS_MAP).write_text(json.dumps(special_map))
        (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
        (out / "config.json").write_text(json.dumps({**base_config, "model_type": model_type}))


def transformers_class(tokenizer: Any) -> str:
    return next(
        c.__name__ for c in type(tokenizer).__mro__ if c.__module__.startswith("transformers.")
    )


def load(directory: Path) -> Any:
    from vllm.tokenizers.registry import get_tokenizer

    return get_tokenizer(str(directory))


def record_variant(name: str) -> dict[str, Any]:
    tokenizer = load(OUT / name)
    texts = [
        {"text": t, "add_special_tokens": add, "ids": tokenizer.encode(t, add_special_tokens=add)}
        for t in TEXTS
        for add in (True, False)
    ]
    chats = []
    for messages in CHATS:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        chats.append(
            {
                "messages": messages,
                "text": rendered,
                "ids": tokenizer.encode(rendered, add_special_tokens=False),
            }
        )
    return {"class": transformers_class(tokenizer), "texts": texts, "chats": chats}


def record_grid() -> list[dict[str, Any]]:
    grid = []
    source = OUT / "spm-gemma"  # has <unk>, so every class can load it
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in GRID_TYPES:
            for hub_class in GRID_CLASSES:
                directory = Path(tmp) / f"{model_type}-{hub_class}"
                directory.mkdir()
                shutil.copy(source / "tokenizer.json", directory)
                config = {"model_max_length": 4096}
                if hub_class is not None:
                    config["tokenizer_class"] = hub_class
                (directory / "tokenizer_config.json").write_text(json.dumps(config))
                base = json.loads((source / "config.json").read_text())
                (directory / "config.json").write_text(
                    json.dumps({**base, "model_type": model_type})
                )
                try:
                    chosen: str | None = transformers_class(load(directory))
                except Exception as exc:  # a class that cannot load this file: recorded as such
                    chosen = None
                    print(model_type, hub_class, "fails:", exc, flush=True)
                grid.append(
                    {"model_type": model_type, "tokenizer_class": hub_class, "class": chosen}
                )
    return grid


def e2e(records: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from capture_tokenization_corpus import free_port, post, start, wait_ready

    checks = []
    logs = Path(tempfile.gettempdir()) / "tandem-tokenizer-classes"
    logs.mkdir(exist_ok=True)
    for name in names:
        port, log = free_port(), logs / f"{name}.log"
        proc = start(OUT / name, port, log)
        try:
            wait_ready(port, proc, log)
            for case in records[name]["texts"]:
                body = {
                    "model": "m",
                    "prompt": case["text"],
                    "add_special_tokens": case["add_special_tokens"],
                }
                status, answer = post(port, "/tokenize", body)
                ids = answer.get("tokens") if isinstance(answer, dict) else None
                checks.append({"model": name, "request": body, "status": status, "ids": ids})
                assert ids == case["ids"], (name, case, ids)
            for chat in records[name]["chats"]:
                body = {"model": "m", "messages": chat["messages"], "add_generation_prompt": True}
                status, answer = post(port, "/tokenize", body)
                ids = answer.get("tokens") if isinstance(answer, dict) else None
                checks.append({"model": name, "request": body, "status": status, "ids": ids})
                assert ids == chat["ids"], (name, chat, ids)
        finally:
            proc.terminate()
            proc.wait(30)
        print(
            name,
            "renderer agrees on",
            sum(c["model"] == name for c in checks),
            "requests",
            flush=True,
        )
    return checks


def main() -> None:
    import transformers
    import vllm

    build_variants()
    records = {name: record_variant(name) for name in VARIANTS}
    for name, record in records.items():
        print(name, record["class"], flush=True)
    result: dict[str, Any] = {
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "variants": records,
        "grid": record_grid(),
    }
    if "--e2e" in sys.argv:
        result["renderer"] = e2e(records, ["spm-llama2", "spm-gemma"])
    (FIXTURES / "classes.json").write_text(json.dumps(result, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
