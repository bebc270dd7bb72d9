"""Parses the load figures the router needs out of an engine's Prometheus text (vLLM names)."""

from __future__ import annotations

import re

_WANTED = {
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:num_requests_running": "running",
    b"vllm:kv_cache_usage_perc": "kv_usage",
}


_CACHE_CONFIG = b"vllm:cache_config_info{"
_LABEL = re.compile(rb'[{,](num_gpu_blocks|block_size)="(\d+)"')


def parse_engine_load(text: bytes) -> dict[str, float]:
    """Sums each wanted gauge over its label sets (one engine may report several DP ranks).

    kv_usage is averaged instead of summed. kv_capacity is the KV cache's size in tokens,
    num_gpu_blocks · block_size from `vllm:cache_config_info`'s labels, summed over its series
    (0 when the engine reports none). Unknown or malformed lines are skipped.
    """
    sums = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0, "kv_capacity": 0.0}
    kv_series = 0
    for line in text.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        if line.startswith(_CACHE_CONFIG):
            labels = dict(_LABEL.findall(line[: line.rfind(b"}") + 1]))
            if b"num_gpu_blocks" in labels and b"block_size" in labels:
                sums["kv_capacity"] += int(labels[b"num_gpu_blocks"]) * int(labels[b"block_size"])
            continue
        brace = line.find(b"{")
        space = line.find(b" ")
        end = brace if 0 < brace < space or (brace > 0 and space < 0) else space
        field = _WANTED.get(line[:end])
        if field is None:
            continue
        try:
            value = float(line.rsplit(b"}", 1)[-1].split()[0] if brace > 0 else line.split()[1])
        except (ValueError, IndexError):
            continue
        sums[field] += value
        if field == "kv_usage":
            kv_series += 1
    if kv_series > 1:
        sums["kv_usage"] /= kv_series
    return sums
