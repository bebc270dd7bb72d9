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
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
DTYPE = torch.bfloat16


class Llama8BShape:
    """Random-weight transformer with Llama-3.1-8B's shapes and a static KV cache."""

    def __init__(self, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=DTYPE, generator=g) * 0.02

        self.embed = w(VOCAB, HIDDEN)
        self.lm_head = w(HIDDEN, VOCAB)
        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [
            {
                "wqkv": w(HIDDEN, qkv),
                "wo": w(HEADS * HEAD_DIM, HIDDEN),
                "w13": w(HIDDEN, 2 * FFN),
                "w2": w(FFN, HIDDEN),
                "n1": torch.ones(HIDDEN, device=device, dtype=DTYPE),
                "n2": torch.ones(HIDDEN, device=device, dtype=DTYPE),
            }
            for _ in range(LAYERS)
        ]
        self.device = device
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
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
        k_cache: list[torch.Tensor],  # per layer [B, S, KV_HEADS, HEAD_DIM]
        v_cache: list[torch.Tensor],
        start: int,
    ) -> torch.Tensor:
        b, t = tokens.shape
        positions = torch.arange(start, start + t, device=self.device)
        x = self.embed[tokens]
        total = start + t
        mask = None if t == 1 else causal_lower_right(t, total)
        for layer, kc, vc in zip(self.layers, k_cache, v_cache, strict=True):
            h = F.rms_norm(x, (HIDDEN,), layer["n1"])
            qkv = h @ layer["wqkv"]
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            q = self.rope(q.view(b, t, HEADS, HEAD_DIM), positions)
            k = self.rope(k.view(b, t, KV_HEADS, HEAD_DIM), positions)
            kc[:, start:total] = k
            vc[:, start:total] = v.view(b, t, KV_HEADS, HEAD_DIM)
            attn = attention(q, kc[:, :total], vc[:, :total], mask)
            x = x + attn.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM) @ layer["wo"]
            h = F.rms_norm(x, (HIDDEN,), layer["n2"])
            gate, up = (h @ layer["w13"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["w2"]
        return x[:, -1] @ self.lm_head


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object) -> torch.Tensor:
    """SDPA over [B, T, H, D] tensors; grouped-query heads are expanded where a mask is needed,
    because the bottom-right causal kernels take equal head counts."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def kv_cache(
    batch: int, length: int, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (batch, length, KV_HEADS, HEAD_DIM)
    ks = [torch.randn(shape, device=device, dtype=DTYPE) for _ in range(LAYERS)]
    vs = [torch.randn(shape, device=device, dtype=DTYPE) for _ in range(LAYERS)]
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
def measure_prefill(model: Llama8BShape, repeats: int) -> list[dict[str, float]]:
    rows = []
    for batch, new, cached in PREFILL_GRID:
        ks, vs = kv_cache(batch, cached + new, model.device)
        tokens = torch.randint(0, VOCAB, (batch, new), device=model.device)
        step = functools.partial(model.forward, tokens, ks, vs, cached)
        times = graph_time_ms(step, repeats)
        rows.append(timing_row(times, batch=batch, new_tokens=new, cached_tokens=cached))
        print(f"prefill B={batch:<3} L={new:<6} P={cached:<6} {rows[-1]['ms']:9.3f} ms", flush=True)
        del step, ks, vs
        torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def measure_decode(model: Llama8BShape, repeats: int) -> list[dict[str, float]]:
    rows = []
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if batch * (context + 1) > MAX_DECODE_KV_TOKENS:
                continue
            ks, vs = kv_cache(batch, context + 1, model.device)
            tokens = torch.randint(0, VOCAB, (batch, 1), device=model.device)
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
    model = Llama8BShape(device)
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": {
            "layers": LAYERS,
            "hidden": HIDDEN,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "ffn": FFN,
            "vocab": VOCAB,
            "dtype": "bfloat16",
        },
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
