"""Fit the emulator's step-time model to step times measured on a GPU (h200_profile.py's JSON).

The model, one engine step = one forward pass over a mixed batch:

    t = base_s
      + per_token_s          * scheduled_tokens        (prefill chunk tokens + 1 per decode sequence)
      + per_attention_pair_s * sum_chunks chunk_len * (cached_ctx + chunk_len / 2)
      + per_decode_seq_s     * decode_sequences
      + per_context_token_s  * sum of the decode sequences' context lengths

fitted by non-negative least squares on relative error (each row weighted by 1 / measured time),
so short decode steps count as much as long prefills.

With `--speculative` (h200_speculative.py's JSON) it also fits what verifying k drafts adds to a
decode step of B sequences over C cached tokens, against the k = 0 step of the same run:

    verify(B, C, k) - verify(B, C, 0) = verify_base_s + per_verify_token_s * B * k
                                        + per_verify_context_token_s * B * k * C

each draft proposer's decode step (base_s + per_seq_s * B + per_context_token_s * B * C), and the
memory model (weights, activation bytes per prefill token, memory outside PyTorch). Usage:

    python benchmarks/fit_profile.py docs/profiles/h200-llama-3.1-8b-raw.json \
        --speculative docs/profiles/h200-llama-3.1-8b-speculative-raw.json \
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
    coefficients, predicted = fit_rows(
        features.tolist(), measured.tolist(), (1.0 / measured).tolist()
    )
    table = [(label, m, p) for label, m, p in zip(labels, measured, predicted, strict=True)]
    return {name: float(f"{c:.4g}") for name, c in zip(TERMS, coefficients, strict=True)}, table


def fit_rows(
    features: list[list[float]], measured: list[float], weights: list[float]
) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares of measured ~ features, rows weighted; (coefficients, predicted)."""
    a, b, w = np.array(features), np.array(measured), np.array(weights)
    coefficients = nonnegative_least_squares(a * w[:, None], b * w)
    return coefficients, a @ coefficients


def fit_speculative(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the profile's `speculative` section, its `memory` section) from h200_speculative.py's JSON."""
    plain = {(r["batch"], r["context"]): r["ms"] / 1e3 for r in raw["verify"] if r["k"] == 0}
    rows = [r for r in raw["verify"] if r["k"] > 0]
    features = [[1.0, r["batch"] * r["k"], r["batch"] * r["k"] * r["context"]] for r in rows]
    extra = [r["ms"] / 1e3 - plain[(r["batch"], r["context"])] for r in rows]
    # relative to the whole verify step, which is what the emulated step time is made of
    weights = [1e3 / r["ms"] for r in rows]
    (base, per_token, per_pair), predicted = fit_rows(features, extra, weights)
    errors = [abs(p - e) / (r["ms"] / 1e3) for p, e, r in zip(predicted, extra, rows, strict=True)]
    print(
        f"verify: base {base * 1e3:.3f} ms, {per_token * 1e6:.2f} us per drafted token, "
        f"{per_pair * 1e9:.3f} ns per drafted token x context; |error| of the verify step "
        f"mean {100 * np.mean(errors):.1f}%, max {100 * max(errors):.1f}% over {len(rows)} rows"
    )
    drafts = {}
    for name, measured in raw["draft"].items():
        features = [[1.0, r["batch"], r["batch"] * r["context"]] for r in measured]
        coefficients, predicted = fit_rows(
            features, [r["ms"] / 1e3 for r in measured], [1e3 / r["ms"] for r in measured]
        )
        worst = max(
            abs(p - r["ms"] / 1e3) / (r["ms"] / 1e3)
            for p, r in zip(predicted, measured, strict=True)
        )
        print(f"draft {name}: {[f'{c:.4g}' for c in coefficients]}, max |error| {100 * worst:.1f}%")
        drafts[name] = dict(
            zip(("base_s", "per_seq_s", "per_context_token_s"), (float(f"{c:.4g}") for c in coefficients), strict=True)
        )  # fmt: skip
    speculative = {
        "verify_base_s": float(f"{base:.4g}"),
        "per_verify_token_s": float(f"{per_token:.4g}"),
        "per_verify_context_token_s": float(f"{per_pair:.4g}"),
        # vLLM's method names: a draft model, and the one-layer heads (EAGLE, EAGLE-3, MTP,
        # Medusa and MLP speculators cost about one decoder layer plus the LM head)
        "drafts": {
            "draft_model": drafts["llama-1b"],
            **{
                m: dict(drafts["eagle"])
                for m in ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator")
            },
        },
    }
    activations = raw["activations"]
    slope = (activations[-1]["peak_bytes"] - activations[0]["peak_bytes"]) / (
        activations[-1]["prefill_tokens"] - activations[0]["prefill_tokens"]
    )
    utilisation = raw["utilisation"][0]
    memory = {
        "total_bytes": int(raw["nvidia_smi_idle"]["fb_total_mib"]) * 2**20,
        "weights_bytes": int(raw["weights_bytes"]),
        "activation_bytes_per_token": round(slope),
        "non_torch_bytes": int(
            (utilisation["nvml_fb_used_mib"] - utilisation["torch_reserved_mib"]) * 2**20
        ),
        "reference_gpu_memory_utilization": 0.9,  # where num_gpu_blocks was sized (vLLM's default)
        "reference_max_num_batched_tokens": 8192,
    }
    return speculative, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--name", default="h200-llama-3.1-8b-bf16")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--speculative", type=Path, help="h200_speculative.py's JSON")
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
    if args.speculative:
        speculative, memory = fit_speculative(json.loads(args.speculative.read_text()))
        profile["speculative"] = speculative
        profile["memory"] = memory
    text = yaml.safe_dump(profile, sort_keys=False, width=100)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
