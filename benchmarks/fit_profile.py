"""Fit the emulator's step-time model to step times measured on a GPU (h200_profile.py's JSON).

The model, one engine step = one forward pass over a mixed batch:

    t = base_s
      + per_token_s          * scheduled_tokens        (prefill chunk tokens + 1 per decode sequence)
      + per_attention_pair_s * sum_chunks chunk_len * (cached_ctx + chunk_len / 2)
      + per_decode_seq_s     * decode_sequences
      + per_context_token_s  * sum of the decode sequences' context lengths

fitted by non-negative least squares on relative error (each row weighted by 1 / measured time),
so short decode steps count as much as long prefills. Usage:

    python benchmarks/fit_profile.py docs/profiles/h200-llama-3.1-8b-raw.json \
        --name h200-llama-3.1-8b-bf16 --out tandem/emulator/profiles/h200-llama-3.1-8b.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

TERMS = ["base_s", "per_token_s", "per_attention_pair_s", "per_decode_seq_s", "per_context_token_s"]


def prefill_features(batch: int, new: int, cached: int) -> list[float]:
    return [1.0, batch * new, batch * new * (cached + new / 2), 0.0, 0.0]


def decode_features(batch: int, context: int) -> list[float]:
    return [1.0, batch, 0.0, batch, batch * context]


def design(raw: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    rows, times, labels = [], [], []
    for r in raw["prefill"]:
        rows.append(prefill_features(r["batch"], r["new_tokens"], r["cached_tokens"]))
        times.append(r["ms"] / 1e3)
        labels.append(f"prefill B={r['batch']} L={r['new_tokens']} P={r['cached_tokens']}")
    for r in raw["decode"]:
        rows.append(decode_features(r["batch"], r["context"]))
        times.append(r["ms"] / 1e3)
        labels.append(f"decode B={r['batch']} C={r['context']}")
    return np.array(rows), np.array(times), labels


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the terms that come out negative."""
    active = list(range(a.shape[1]))
    while True:
        scale = np.abs(a[:, active]).max(axis=0)
        solution, *_ = np.linalg.lstsq(a[:, active] / scale, b, rcond=None)
        solution = solution / scale
        if (solution >= 0).all():
            full = np.zeros(a.shape[1])
            full[active] = solution
            return full
        active = [i for i, value in zip(active, solution, strict=True) if value >= 0]


def fit(raw: dict[str, Any]) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
    features, measured, labels = design(raw)
    weights = 1.0 / measured
    coefficients = nonnegative_least_squares(features * weights[:, None], measured * weights)
    predicted = features @ coefficients
    table = [(label, m, p) for label, m, p in zip(labels, measured, predicted, strict=True)]
    return {name: float(f"{c:.4g}") for name, c in zip(TERMS, coefficients, strict=True)}, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--name", default="h200-llama-3.1-8b-bf16")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--transfer-bandwidth",
        type=float,
        default=45e9,
        help="P/D KV transfer rate, bytes/s (default: a 400 Gb/s RDMA NIC at ~90%%)",
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=51000,
        help="KV capacity in 16-token blocks (H200: 0.9 x 141 GB - weights - activations)",
    )
    args = parser.parse_args()
    raw = json.loads(args.raw.read_text())
    step, table = fit(raw)
    errors = [abs(p - m) / m for _, m, p in table]
    print(f"{'configuration':<32} {'measured ms':>12} {'model ms':>10} {'error':>7}")
    for label, m, p in table:
        print(f"{label:<32} {m * 1e3:12.3f} {p * 1e3:10.3f} {100 * (p - m) / m:6.1f}%")
    print(f"mean |error| {100 * np.mean(errors):.1f}%, max {100 * max(errors):.1f}%")
    model = raw["model"]
    profile = {
        "name": args.name,
        "description": (
            f"Llama-3.1-8B-shaped model, random bf16 weights, measured on one {raw['device']} "
            f"(torch {raw['torch']}, CUDA {raw['cuda']}) by benchmarks/h200_profile.py and fitted by "
            f"benchmarks/fit_profile.py; mean |error| {100 * np.mean(errors):.1f}%, max "
            f"{100 * max(errors):.1f}% over {len(table)} configurations. See docs/profiles/."
        ),
        "model": {
            "layers": model["layers"],
            "kv_heads": model["kv_heads"],
            "head_dim": model["head_dim"],
            "dtype_bytes": 2,
        },
        "step": step,
        "kv_transfer": {
            "bandwidth_bytes_per_s": args.transfer_bandwidth,
            "latency_s": 0.0005,
            "emulated_bytes_per_token": 0,
            "bytes_scale": 0.001,
        },
        "capacity": {"num_gpu_blocks": args.num_gpu_blocks},
    }
    text = yaml.safe_dump(profile, sort_keys=False, width=100)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
