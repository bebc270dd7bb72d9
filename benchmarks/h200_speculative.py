"""Measure what speculative decoding costs on one GPU, for the emulator's timing profile.

Beside `h200_profile.py` (whose random-bf16 Llama-3.1-8B-shaped model and CUDA-graph timing this
reuses), it times:

* verify: B sequences, k + 1 new tokens each (the last accepted token and k drafted ones) over C
  cached tokens, logits at every position, for k = 0..8 (k = 0 is a plain decode step timed by the
  same code, so the ratio verify(k) / decode needs no cross-script comparison);
* draft: one decode step of the draft proposers a pool can be given: a Llama-3.2-1B-shaped draft
  model (16 layers, hidden 2048, 32 query and 8 KV heads of 64, SwiGLU 8192, vocabulary 128256)
  and an EAGLE-style head (one decoder layer of the 8B shape plus its 128256-entry LM head);
* activations: peak memory above the weights and KV cache during one eager prefill forward of
  L tokens, the spike a prefill adds to a GPU's used memory;
* utilisation: what NVML (`nvidia-smi`) reports as GPU utilisation and used memory while decode
  steps run back to back and with idle gaps (duty cycle 1, 1/2, 1/4), to check that "busy fraction
  of the step loop" is what DCGM_FI_DEV_GPU_UTIL reads.

Attention for the verify and draft steps packs each KV head's query heads and the k + 1 positions
into one query block ([B, KV_H, T*G, D]) with a lower-right causal mask, so grouped-query heads are
read in place as vLLM's kernels read them (expanding them, as the prefill profile does, would copy
the whole KV cache per layer and overstate verification at large B*C). Usage (on the GPU machine):

    python benchmarks/h200_speculative.py --out spec.json

The JSON is rewritten after every section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from h200_profile import (
    LLAMA_8B,
    RandomLlama,
    Shape,
    expanded_attention,
    graph_time_ms,
    kv_cache,
    timing_row,
)

LLAMA_1B = Shape(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256)
EAGLE_HEAD = dataclasses.replace(LLAMA_8B, layers=1)
DRAFT_LENGTHS = range(0, 9)
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
CONTEXTS = [1024, 4096]
PREFILL_TOKENS = [256, 1024, 2048, 4096, 8192, 16384]
DUTY_CYCLES = [1.0, 0.5, 0.25]


def packed_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> torch.Tensor:
    """Attention with each KV head's G query heads and T positions packed into one query block.

    Row r = t * G + g of the block is position start + t, so it sees keys 0..start + t.
    """
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    packed = (
        q.view(b, t, kv_heads, groups, d).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, t * groups, d)
    )
    mask = None
    if t > 1:
        rows = torch.arange(t * groups, device=q.device) // groups + start
        mask = torch.arange(k.shape[1], device=q.device)[None, :] <= rows[:, None]
    out = F.scaled_dot_product_attention(
        packed, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return (
        out.view(b, kv_heads, t, groups, d)
        .permute(0, 2, 1, 3, 4)
        .reshape(b, t, heads, d)
        .transpose(1, 2)
    )


def check_packed_attention(device: torch.device) -> float:
    """Relative difference between packed and expanded attention on random inputs (bf16)."""
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(3, 5, 32, 128, device=device, generator=g).to(torch.bfloat16)
    k = torch.randn(3, 69, 8, 128, device=device, generator=g).to(torch.bfloat16)
    v = torch.randn(3, 69, 8, 128, device=device, generator=g).to(torch.bfloat16)
    ours = packed_gqa_attention(q, k, v, 64).float()
    ref = expanded_attention(q.double(), k.double(), v.double(), 64).float()
    return float((ours - ref).norm() / ref.norm())


@torch.inference_mode()
def measure_verify(model: RandomLlama, repeats: int, sink: dict[str, Any]) -> None:
    for context in CONTEXTS:
        for batch in BATCHES:
            ks, vs = kv_cache(batch, context + max(DRAFT_LENGTHS) + 1, model.device)
            for k in DRAFT_LENGTHS:
                tokens = torch.randint(0, LLAMA_8B.vocab, (batch, k + 1), device=model.device)
                step = functools.partial(model.forward, tokens, ks, vs, context, all_logits=True)
                row = timing_row(graph_time_ms(step, repeats), batch=batch, context=context, k=k)
                sink["verify"].append(row)
                print(f"verify B={batch:<4} C={context:<5} k={k} {row['ms']:8.3f} ms", flush=True)
                del step
                torch.cuda.empty_cache()
            del ks, vs
            torch.cuda.empty_cache()


@torch.inference_mode()
def measure_draft(name: str, shape: Shape, repeats: int, sink: dict[str, Any]) -> None:
    device = torch.device("cuda")
    model = RandomLlama(device, shape, packed_gqa_attention)
    sink["draft_weights_bytes"][name] = (
        sum(t.numel() * t.element_size() for layer in model.layers for t in layer.values())
        + 2 * model.embed.numel() * model.embed.element_size()
    )
    for context in CONTEXTS:
        for batch in BATCHES:
            ks, vs = kv_cache(batch, context + 1, device, shape)
            tokens = torch.randint(0, shape.vocab, (batch, 1), device=device)
            step = functools.partial(model.forward, tokens, ks, vs, context)
            row = timing_row(graph_time_ms(step, repeats), batch=batch, context=context)
            sink["draft"][name].append(row)
            print(f"draft {name:<6} B={batch:<4} C={context:<5} {row['ms']:8.3f} ms", flush=True)
            del step, ks, vs
            torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()


@torch.inference_mode()
def measure_activations(model: RandomLlama, sink: dict[str, Any]) -> None:
    """Peak bytes allocated above what is held before one eager prefill of L tokens, through the
    prefill profile's attention (a packed mask would be T*G x S bytes)."""
    model.attention = expanded_attention
    for tokens_n in PREFILL_TOKENS:
        ks, vs = kv_cache(1, tokens_n, model.device)
        tokens = torch.randint(0, LLAMA_8B.vocab, (1, tokens_n), device=model.device)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model.forward(tokens, ks, vs, 0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        sink["activations"].append({"prefill_tokens": tokens_n, "peak_bytes": peak})
        print(f"activations L={tokens_n:<6} {peak / 2**20:9.1f} MiB", flush=True)
        del ks, vs, tokens
        torch.cuda.empty_cache()
    model.attention = packed_gqa_attention


def nvidia_smi() -> dict[str, float] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    fields = "utilization.gpu,memory.used,memory.total,clocks.sm"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout.strip()
    try:
        util, used, total, sm = (float(x) for x in out.splitlines()[0].split(","))
    except (ValueError, IndexError):
        return None
    return {"gpu_util_pct": util, "fb_used_mib": used, "fb_total_mib": total, "sm_clock_mhz": sm}


@torch.inference_mode()
def measure_utilisation(model: RandomLlama, sink: dict[str, Any], seconds: float) -> None:
    """NVML's utilisation while a decode step (B=32, C=1024) replays at several duty cycles."""
    ks, vs = kv_cache(32, 1025, model.device)
    tokens = torch.randint(0, LLAMA_8B.vocab, (32, 1), device=model.device)
    step = functools.partial(model.forward, tokens, ks, vs, 1024)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    step_s = statistics.median(_wall_replays(graph, 20))
    for duty in DUTY_CYCLES:
        samples: list[dict[str, float]] = []
        stop = threading.Event()

        def poll(out: list[dict[str, float]] = samples, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                reading = nvidia_smi()
                if reading:
                    out.append(reading)
                time.sleep(0.2)

        poller = threading.Thread(target=poll)
        busy = 0.0
        started = time.perf_counter()
        poller.start()
        while time.perf_counter() - started < seconds:
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            busy += time.perf_counter() - t0
            time.sleep(step_s * (1 / duty - 1))
        stop.set()
        poller.join()
        wall = time.perf_counter() - started
        settled = samples[2:] or samples
        row = {
            "duty_cycle": duty,
            "busy_fraction": busy / wall,
            "step_ms": step_s * 1e3,
            "nvml_util_pct_mean": statistics.fmean(s["gpu_util_pct"] for s in settled)
            if settled
            else None,
            "nvml_fb_used_mib": settled[-1]["fb_used_mib"] if settled else None,
            "torch_reserved_mib": torch.cuda.memory_reserved() / 2**20,
            "torch_allocated_mib": torch.cuda.memory_allocated() / 2**20,
            "samples": samples,
        }
        sink["utilisation"].append(row)
        print(
            f"duty {duty:4.2f} busy {row['busy_fraction']:.2f} nvml util {row['nvml_util_pct_mean']}"
            f" fb {row['nvml_fb_used_mib']} MiB torch reserved {row['torch_reserved_mib']:.0f} MiB",
            flush=True,
        )
    del graph, step, ks, vs
    torch.cuda.empty_cache()


def _wall_replays(graph: torch.cuda.CUDAGraph, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--utilisation-seconds", type=float, default=3.0)
    args = parser.parse_args()
    out = Path(args.out)
    device = torch.device("cuda")
    started = time.time()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "target": {**dataclasses.asdict(LLAMA_8B), "dtype": "bfloat16"},
        "drafts": {
            "llama-1b": dataclasses.asdict(LLAMA_1B),
            "eagle": dataclasses.asdict(EAGLE_HEAD),
        },
        "method": "median of CUDA-event timings of CUDA-graph replays after 3 warm-ups",
        "repeats": args.repeats,
        "nvidia_smi_idle": nvidia_smi(),
        "packed_attention_rel_error": check_packed_attention(device),
        "verify": [],
        "draft": {"llama-1b": [], "eagle": []},
        "draft_weights_bytes": {},
        "activations": [],
        "utilisation": [],
    }
    print(
        f"packed vs expanded attention, relative error {result['packed_attention_rel_error']:.2e}"
    )

    def save() -> None:
        result["seconds"] = time.time() - started
        out.write_text(json.dumps(result, indent=1))

    model = RandomLlama(device, LLAMA_8B, packed_gqa_attention)
    result["weights_bytes"] = torch.cuda.memory_allocated()
    sections = [
        lambda: measure_verify(model, args.repeats, result),
        lambda: measure_utilisation(model, result, args.utilisation_seconds),
        lambda: measure_activations(model, result),
        lambda: measure_draft("eagle", EAGLE_HEAD, args.repeats, result),
        lambda: measure_draft("llama-1b", LLAMA_1B, args.repeats, result),
    ]
    for section in sections:
        try:
            section()
        except Exception as error:  # a failed section must not lose the others
            result.setdefault("errors", []).append(repr(error))
            print("section failed:", repr(error), flush=True)
        save()
    print(f"total {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
