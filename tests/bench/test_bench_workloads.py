"""Workload generators: deterministic per seed, the requested shapes, and length-distribution parsing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pydantic import ValidationError

from tandem.bench.main import build_parser, parse_phases, workload_from_args
from tandem.bench.presets import PRESETS, preset
from tandem.bench.spec import Burst, FixedQPS, LengthDist, Mixed, Phase, SharedPrefix
from tandem.bench.workloads import build_schedule, poisson_arrivals


@pytest.mark.parametrize("name", list(PRESETS))
def test_same_seed_same_schedule_other_seed_other_schedule(name: str) -> None:
    spec = preset(name)
    again = build_schedule(spec)
    assert build_schedule(spec) == again
    other = build_schedule(spec.model_copy(update={"seed": spec.seed + 1}))
    assert [p.prompt for p in other.measured] != [p.prompt for p in again.measured]


def test_warmup_count_does_not_change_measured_requests() -> None:
    spec = FixedQPS(num_requests=20, warmup_requests=2)
    more_warmup = spec.model_copy(update={"warmup_requests": 9})
    assert build_schedule(spec).measured == build_schedule(more_warmup).measured
    assert len(build_schedule(more_warmup).warmup) == 9


def test_poisson_arrivals_have_the_requested_rate() -> None:
    times = poisson_arrivals(np.random.default_rng(7), qps=20, n=4000)
    assert times[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(times))
    assert 19 < len(times) / times[-1] < 21


def test_fixed_qps_prompts_follow_the_length_distribution_and_are_distinct() -> None:
    spec = FixedQPS(
        num_requests=300,
        input=LengthDist(kind="uniform", low=50, high=60),
        output=LengthDist(mean=7),
    )
    measured = build_schedule(spec).measured
    assert all(
        50 <= p.prompt_words <= 60 and len(p.prompt.split()) == p.prompt_words for p in measured
    )
    assert {p.max_tokens for p in measured} == {7}
    # Distinct from the first 16 words on: no accidental prefix-cache hits between requests.
    assert len({tuple(p.prompt.split()[:16]) for p in measured}) == len(measured)


def test_burst_follows_its_phases() -> None:
    spec = Burst(
        phases=[
            Phase(qps=2, duration_s=20, name="low"),
            Phase(qps=20, duration_s=10, name="high"),
            Phase(qps=2, duration_s=20, name="low2"),
        ]
    )
    measured = build_schedule(spec).measured
    by_phase = {name: [p for p in measured if p.phase == name] for name in ("low", "high", "low2")}
    assert all(0 <= p.at_s < 20 for p in by_phase["low"])
    assert all(20 <= p.at_s < 30 for p in by_phase["high"])
    assert all(30 <= p.at_s < 50 for p in by_phase["low2"])
    assert len(by_phase["high"]) > 3 * len(by_phase["low"]) / 2  # 200 expected vs 40


def test_mixed_has_long_and_short_classes() -> None:
    spec = Mixed(num_requests=400, long_fraction=0.25)
    measured = build_schedule(spec).measured
    long_ = [p for p in measured if p.klass == "long"]
    assert 0.18 < len(long_) / len(measured) < 0.32
    assert min(p.prompt_words for p in long_) >= spec.long_input.low
    assert max(p.prompt_words for p in measured if p.klass == "short") <= spec.short_input.high


def test_shared_prefix_groups_share_exactly_their_prefix() -> None:
    spec = SharedPrefix(num_requests=60, groups=3, share_ratio=0.5, input=LengthDist(mean=200))
    measured = build_schedule(spec).measured
    assert spec.prefix_tokens() == 100
    for p in measured:
        assert p.prompt.startswith(p.prefix + " ")
        assert len(p.prefix.split()) == 100
        assert p.prompt_words == 200
    assert len({p.prefix for p in measured}) == 3
    assert {p.prefix for p in build_schedule(spec).warmup} <= {p.prefix for p in measured}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("128", LengthDist(kind="fixed", mean=128)),
        ("fixed:64", LengthDist(kind="fixed", mean=64)),
        ("uniform:10-20", LengthDist(kind="uniform", low=10, high=20, mean=15)),
        (
            "lognormal:256,0.8,16-4096",
            LengthDist(kind="lognormal", mean=256, sigma=0.8, low=16, high=4096),
        ),
        ("normal:100,0.1", LengthDist(kind="normal", mean=100, sigma=0.1)),
    ],
)
def test_length_distribution_syntax(text: str, expected: LengthDist) -> None:
    assert LengthDist.parse(text) == expected


def test_bad_length_distributions_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        LengthDist.parse("zipf:3")
    with pytest.raises(ValidationError):
        LengthDist(kind="uniform", low=9, high=3)


def test_cli_overrides_apply_to_the_preset_and_refuse_foreign_fields() -> None:
    args = build_parser().parse_args(
        ["--preset", "shared-prefix", "--share-ratio", "0.9", "--qps", "3", "--seed", "5"]
    )
    spec = workload_from_args(args)
    assert isinstance(spec, SharedPrefix)
    assert (spec.share_ratio, spec.qps, spec.seed) == (0.9, 3, 5)
    with pytest.raises(ValueError, match="does not apply"):
        workload_from_args(build_parser().parse_args(["--preset", "quick", "--share-ratio", "0.5"]))
    assert [p.qps for p in parse_phases("2x5,10x3")] == [2, 10]
