"""Named workloads: `quick` for a first look, and one preset per production shape of the method."""

from __future__ import annotations

from collections.abc import Callable

from tandem.bench.spec import Burst, FixedQPS, LengthDist, Mixed, Phase, SharedPrefix, Trace

WorkloadSpec = FixedQPS | Burst | Mixed | SharedPrefix | Trace

PRESETS: dict[str, tuple[str, Callable[[], WorkloadSpec]]] = {
    "quick": (
        "40 requests at 4 qps, lognormal prompts around 256 tokens, 64 output tokens (~15 s)",
        lambda: FixedQPS(
            qps=4,
            num_requests=40,
            warmup_requests=4,
            input=LengthDist(kind="lognormal", mean=256, sigma=0.5, low=16, high=2048),
            output=LengthDist(kind="fixed", mean=64),
        ),
    ),
    "fixed-qps": (
        "300 requests at 8 qps (Poisson), prompts around 512 tokens, outputs around 128",
        lambda: FixedQPS(
            qps=8,
            num_requests=300,
            output=LengthDist(kind="lognormal", mean=128, sigma=0.5, low=8, high=1024),
        ),
    ),
    "burst": (
        "2 qps for 15 s, 20 qps for 10 s, 2 qps for 20 s: degradation and recovery",
        lambda: Burst(
            phases=[
                Phase(qps=2, duration_s=15, name="low"),
                Phase(qps=20, duration_s=10, name="high"),
                Phase(qps=2, duration_s=20, name="recovery"),
            ],
            output=LengthDist(kind="lognormal", mean=128, sigma=0.5, low=8, high=1024),
        ),
    ),
    "mixed": (
        "200 requests at 4 qps, 20% long documents (~4k tokens) among short chats (~128 tokens)",
        lambda: Mixed(output=LengthDist(kind="lognormal", mean=128, sigma=0.5, low=16, high=512)),
    ),
    "shared-prefix": (
        "200 requests at 8 qps in 8 groups, 2k-token prompts of which 75% is the group's system prompt",
        lambda: SharedPrefix(qps=8, output=LengthDist(kind="fixed", mean=64)),
    ),
}


def preset(name: str) -> WorkloadSpec:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name][1]()
