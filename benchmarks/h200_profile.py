"""Measure the step times of a Llama-3.1-8B-shaped model on one GPU, for the emulator's timing profile.

The model has Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 query heads, 8 KV heads of 128,
SwiGLU 14336, vocabulary 128256) with random bf16 weights; what is timed is one forward pass:

* prefill: B prompts of L new tokens each over P already-cached tokens (P = 0 for a fresh prompt,
  P > 0 for a chunk of chunked prefill), causal attention aligned to the bottom right;
* decode: B sequences, one new token each, over C cached tokens.

Each forward pass is captured in a CUDA graph and its replays are timed, as vLLM replays captured
graphs rather than launching every kernel from Python.

Attention runs through PyTorch's scaled_dot_product_attention (flash / memory-efficient kernels),
the KV cache is a static, preallocated tensor. Each configuration is warmed up, then timed with
CUDA events; the median of the repeats is kept. Usage (on the GPU machine):

    python benchmarks/h200_profile.py --out results.json

and then, anywhere: `python benchmarks/fit_profile.py results.json` fits the emulator's step model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama-style decoder's dimensions."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int


LLAMA_8B = Shape(
    layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256
)
# attention(q [B, T, H, D], k and v [B, S, KV_H, D] with S = start + T, start) -> [B, H, T, D]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def expanded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> torch.Tensor:
    """SDPA over [B, T, H, D] tensors; grouped-query heads are expanded where a mask is needed,
    because the bottom-right causal kernels take equal head counts."""
    t, total = q.shape[1], k.shape[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(t, total))


class RandomLlama:
    """Random-weight transformer with Llama-3.1-8B's shapes (or another `Shape`) and a static KV
    cache."""

    def __init__(
        self,
        device: torch.device,
        shape: Shape = LLAMA_8B,
        attention: Attention = expanded_attention,
    ) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.shape, self.attention = shape, attention
        hidden, heads, kv_heads, head_dim = (
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
        )

        def w(*dims: int) -> torch.Tensor:
            return torch.randn(*dims, device=device, dtype=DTYPE, generator=g) * 0.02

        self.embed = w(shape.vocab, hidden)
        self.lm_head = w(hidden, shape.vocab)
        qkv = (heads + 2 * kv_heads) * head_dim
        self.layers = [
            {
                "wqkv": w(hidden, qkv),
                "wo": w(heads * head_dim, hidden),
                "w13": w(hidden, 2 * shape.ffn),
                "w2": w(shape.ffn, hidden),
                "n1": torch.ones(hidden, device=device, dtype=DTYPE),
                "n2": torch.ones(hidden, device=device, dtype=DTYPE),
            }
            for _ in range(shape.layers)
        ]
        self.device = device
        inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        self.inv_freq = inv

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos().to(DTYPE), freqs.sin().to(DTYPE)
        x1, x2 = x[..., ::2], x[..., 1::2]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        k_cache: list[torch.Tensor],  # per layer [B, S, kv_heads, head_dim]
        v_cache: list[torch.Tensor],
        start: int,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Logits of the last position, or of every position (`all_logits`, as speculative
        verification needs)."""
        b, t = tokens.shape
        s = self.shape
        positions = torch.arange(start, start + t, device=self.device)
        x = self.embed[tokens]
        total = start + t
        for layer, kc, vc in zip(self.layers, k_cache, v_cache, strict=True):
            h = F.rms_norm(x, (s.hidden,), layer["n1"])
            qkv = h @ layer["wqkv"]
            q, k, v = qkv.split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1
            )
            q = self.rope(q.view(b, t, s.heads, s.head_dim), positions)
            k = self.rope(k.view(b, t, s.kv_heads, s.head_dim), positions)
            kc[:, start:total] = k
            vc[:, start:total] = v.view(b, t, s.kv_heads, s.head_dim)
            attn = self.attention(q, kc[:, :total], vc[:, :total], start)
            x = x + attn.transpose(1, 2).reshape(b, t, s.heads * s.head_dim) @ layer["wo"]
            h = F.rms_norm(x, (s.hidden,), layer["n2"])
            gate, up = (h @ layer["w13"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w2"]
        return (x if all_logits else x[:, -1]) @ self.lm_head


def kv_cache(
    batch: int, length: int, device: torch.device, model: Shape = LLAMA_8B
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (batch, length, model.kv_heads, model.head_dim)
    ks = [torch.randn(shape, device=device, dtype=DTYPE) for _ in range(model.layers)]
    vs = [torch.randn(shape, device=device, dtype=DTYPE) for _ in range(model.layers)]
    return ks, vs


def time_ms(fn, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def graph_time_ms(fn, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Capture one forward pass in a CUDA graph and time its replays, as vLLM replays captured
    graphs instead of launching each kernel from Python."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, repeats)


def timing_row(times: list[float], **configuration: int) -> dict[str, float]:
    """One configuration's result: its parameters and the median, min and max milliseconds."""
    return {
        **configuration,
        "ms": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
    }


PREFILL_GRID = [  # (batch, new tokens, cached tokens)
    (1, 16, 0),
    (1, 64, 0),
    (1, 128, 0),
    (1, 256, 0),
    (1, 512, 0),
    (1, 1024, 0),
    (1, 2048, 0),
    (1, 4096, 0),
    (1, 8192, 0),
    (1, 16384, 0),
    (2, 512, 0),
    (4, 512, 0),
    (8, 512, 0),
    (16, 512, 0),
    (4, 2048, 0),
    (2, 4096, 0),
    (1, 512, 4096),
    (1, 2048, 2048),
    (1, 2048, 6144),
    (1, 2048, 14336),
    (1, 8192, 8192),
]
DECODE_BATCHES = [1, 8, 16, 32, 64, 128, 256]
DECODE_CONTEXTS = [256, 1024, 4096, 16384]
MAX_DECODE_KV_TOKENS = 600_000  # ~79 GB of KV at 131072 bytes per token, beside 16 GB of weights


@torch.inference_mode()
def measure_prefill(model: RandomLlama, repeats: int) -> list[dict[str, float]]:
    rows = []
    for batch, new, cached in PREFILL_GRID:
        ks, vs = kv_cache(batch, cached + new, model.device)
        tokens = torch.randint(0, LLAMA_8B.vocab, (batch, new), device=model.device)
        step = functools.partial(model.forward, tokens, ks, vs, cached)
        times = graph_time_ms(step, repeats)
        rows.append(timing_row(times, batch=batch, new_tokens=new, cached_tokens=cached))
        print(f"prefill B={batch:<3} L={new:<6} P={cached:<6} {rows[-1]['ms']:9.3f} ms", flush=True)
        del step, ks, vs
        torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def measure_decode(model: RandomLlama, repeats: int) -> list[dict[str, float]]:
    rows = []
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if batch * (context + 1) > MAX_DECODE_KV_TOKENS:
                continue
            ks, vs = kv_cache(batch, context + 1, model.device)
            tokens = torch.randint(0, LLAMA_8B.vocab, (batch, 1), device=model.device)
            step = functools.partial(model.forward, tokens, ks, vs, context)
            times = graph_time_ms(step, repeats)
            rows.append(timing_row(times, batch=batch, context=context))
            print(f"decode  B={batch:<3} C={context:<6} {rows[-1]['ms']:9.3f} ms", flush=True)
            del step, ks, vs
            torch.cuda.empty_cache()
    return rows


def measure_copy_bandwidth(device: torch.device) -> dict[str, float]:
    """Device-to-host (pinned) and device-to-device copy rates, bytes per second."""
    nbytes = 2 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src)
    d2h = statistics.median(time_ms(lambda: host.copy_(src, non_blocking=True), 5))
    d2d = statistics.median(time_ms(lambda: dst.copy_(src), 5))
    return {
        "d2h_bytes_per_s": nbytes / (d2h / 1e3),
        "d2d_bytes_per_s_read_plus_write": 2 * nbytes / (d2d / 1e3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.time()
    model = RandomLlama(device)
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": {**dataclasses.asdict(LLAMA_8B), "dtype": "bfloat16"},
        "method": "median of CUDA-event timings of CUDA-graph replays after 3 warm-ups",
        "repeats": args.repeats,
        "copy": measure_copy_bandwidth(device),
        "prefill": measure_prefill(model, args.repeats),
        "decode": measure_decode(model, args.repeats),
    }
    result["seconds"] = time.time() - started
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["copy"]), f"total {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
