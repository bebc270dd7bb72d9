"""Turn a workload spec into a deterministic schedule of requests (arrival time, prompt, lengths)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.bench.spec import Burst, FixedQPS, LengthDist, Mixed, SharedPrefix

# Common English words that real BPE tokenizers (Llama, Qwen, GPT) encode as one token each when
# preceded by a space, so a prompt of N words is close to N tokens on real engines; the exact
# count comes back in `usage.prompt_tokens` and is what the report uses.
_WORD_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place "
    "made live where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line differ turn cause much "
    "mean before move right boy old too same tell does set three want air well also play small end "
    "put home read hand port large spell add even land here must big high such follow act why ask "
    "men change went light kind off need house picture try us again animal point mother world near "
    "build self earth father head stand own page should country found answer school grow study "
    "still learn plant cover food sun four between state keep eye never last let thought city tree "
    "cross farm hard start might story saw far sea draw left late run while press close night real "
    "life few north open seem together next white children begin got walk example ease paper group "
    "always music those both mark often letter until mile river car feet care second book carry "
    "took science eat room friend began idea fish mountain stop once base hear horse cut sure watch "
    "color face wood main enough plain girl usual young ready above ever red list though feel talk "
    "bird soon body dog family direct pose leave song measure door product black short numeral "
    "class wind question happen complete ship area half rock order fire south problem piece told "
    "knew pass since top whole king space heard best hour better true during hundred five remember "
    "step early hold west ground interest reach fast verb sing listen six table travel less morning"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a schedule; `at_s` is its send time from the start of its phase."""

    index: int
    at_s: float
    prompt: str | list[int]  # the whole prompt (prefix + body); token ids for completions only
    prefix: str  # the shared part ("" when none); sent as the system message for chat
    prompt_words: int
    max_tokens: int
    klass: str  # "default", "short"/"long" (mixed), "group-N" (shared prefix)
    phase: str


@dataclass(frozen=True, slots=True)
class Schedule:
    warmup: list[PlannedRequest]
    measured: list[PlannedRequest]


def words(rng: np.random.Generator, n: int) -> str:
    """`n` random words; different rng states give prompts that differ from the first word on."""
    picks = rng.integers(0, len(WORDS), size=n)
    return " ".join(WORDS[i] for i in picks)


def poisson_arrivals(rng: np.random.Generator, qps: float, n: int) -> list[float]:
    """Send times of `n` Poisson arrivals at rate `qps` (exponential gaps), the first at 0."""
    gaps = rng.exponential(1.0 / qps, size=n)
    if n:
        gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def poisson_window(rng: np.random.Generator, qps: float, duration_s: float) -> list[float]:
    """Send times of a Poisson process at rate `qps` within [0, duration_s)."""
    times: list[float] = []
    t = float(rng.exponential(1.0 / qps))
    while t < duration_s:
        times.append(t)
        t += float(rng.exponential(1.0 / qps))
    return times


def _plain(
    rng: np.random.Generator,
    times: list[float],
    inputs: LengthDist,
    outputs: LengthDist,
    klass: str,
    phase: str,
    start_index: int,
) -> list[PlannedRequest]:
    n = len(times)
    in_lens, out_lens = inputs.sample(rng, n), outputs.sample(rng, n)
    return [
        PlannedRequest(start_index + i, t, words(rng, il), "", il, ol, klass, phase)
        for i, (t, il, ol) in enumerate(zip(times, in_lens, out_lens, strict=True))
    ]


def _fixed_qps(
    spec: FixedQPS, rng: np.random.Generator, n: int, phase: str
) -> list[PlannedRequest]:
    return _plain(
        rng, poisson_arrivals(rng, spec.qps, n), spec.input, spec.output, "default", phase, 0
    )


def _burst(spec: Burst, rng: np.random.Generator) -> list[PlannedRequest]:
    planned: list[PlannedRequest] = []
    offset = 0.0
    for number, phase in enumerate(spec.phases):
        times = [offset + t for t in poisson_window(rng, phase.qps, phase.duration_s)]
        name = phase.name or f"phase-{number}"
        planned += _plain(rng, times, spec.input, spec.output, "default", name, len(planned))
        offset += phase.duration_s
    return planned


def _mixed(spec: Mixed, rng: np.random.Generator, n: int, phase: str) -> list[PlannedRequest]:
    times = poisson_arrivals(rng, spec.qps, n)
    is_long = rng.random(n) < spec.long_fraction
    planned = []
    for i, (t, long_) in enumerate(zip(times, is_long, strict=True)):
        inputs, outputs = (
            (spec.long_input, spec.long_output) if long_ else (spec.short_input, spec.output)
        )
        il, ol = inputs.sample(rng, 1)[0], outputs.sample(rng, 1)[0]
        klass = "long" if long_ else "short"
        planned.append(PlannedRequest(i, t, words(rng, il), "", il, ol, klass, phase))
    return planned


def group_prefixes(spec: SharedPrefix) -> list[str]:
    """The system prompt of each group; a function of the seed only, shared by warm-up and run."""
    rng = np.random.default_rng([spec.seed, 1])
    return [words(rng, spec.prefix_tokens()) for _ in range(spec.groups)]


def _shared_prefix(
    spec: SharedPrefix, rng: np.random.Generator, n: int, phase: str
) -> list[PlannedRequest]:
    prefixes = group_prefixes(spec)
    prefix_len = spec.prefix_tokens()
    times = poisson_arrivals(rng, spec.qps, n)
    totals, out_lens = spec.input.sample(rng, n), spec.output.sample(rng, n)
    group_of = rng.integers(0, spec.groups, size=n)
    planned = []
    for i in range(n):
        prefix = prefixes[int(group_of[i])]
        body_len = max(1, totals[i] - prefix_len)
        body = words(rng, body_len)
        prompt = f"{prefix} {body}" if prefix else body
        planned.append(
            PlannedRequest(
                i,
                times[i],
                prompt,
                prefix,
                prefix_len + body_len,
                out_lens[i],
                f"group-{group_of[i]}",
                phase,
            )
        )
    return planned


def build_schedule(spec: FixedQPS | Burst | Mixed | SharedPrefix) -> Schedule:
    """The warm-up and measured requests of a workload; the same spec always yields the same schedule.

    Warm-up and measured requests come from independent random streams of the seed, so changing
    the number of warm-up requests never changes the measured ones.
    """
    warm_rng = np.random.default_rng([spec.seed, 2])
    run_rng = np.random.default_rng([spec.seed, 3])
    warm_n = spec.warmup_requests
    if isinstance(spec, FixedQPS):
        return Schedule(
            _fixed_qps(spec, warm_rng, warm_n, "warmup"),
            _fixed_qps(spec, run_rng, spec.num_requests, "steady"),
        )
    if isinstance(spec, Burst):
        warm = _plain(warm_rng, [0.0] * warm_n, spec.input, spec.output, "default", "warmup", 0)
        return Schedule(warm, _burst(spec, run_rng))
    if isinstance(spec, Mixed):
        return Schedule(
            _mixed(spec, warm_rng, warm_n, "warmup"),
            _mixed(spec, run_rng, spec.num_requests, "steady"),
        )
    return Schedule(
        _shared_prefix(spec, warm_rng, warm_n, "warmup"),
        _shared_prefix(spec, run_rng, spec.num_requests, "steady"),
    )
