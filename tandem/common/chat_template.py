"""vLLM's `--chat-template` argument, read the same way by the operator and the router."""

from __future__ import annotations


def is_template_text(value: str) -> bool:
    """vLLM's `--chat-template` is a file path unless it holds template syntax or newlines."""
    return any(c in value for c in "{}\n")
