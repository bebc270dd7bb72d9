"""What `router_trace.py` prints and records of a run: the table of each round, Tandem's ratios
to the best peer, and over several rounds (`--rounds`) each figure's median and range and the
paired ratios, one per round, whose spread is the machine's noise."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tandem.bench.spec import SLO

TANDEM_ROUTERS = ("tandem", "tandem-pd", "tandem-predictive", "tandem-pd-predictive")
PEER_ROUTERS = ("sglang", "smg", "vllm", "vllm-pd", "llmd")
BEFORE = "@before"  # a Tandem router of this name's kind, run from `--before-tree`

Rows = dict[str, dict[str, Any]]  # router name -> its row (`router_trace.row_of`)
Spread = tuple[float, float, float]  # median, lowest, highest


def router_kind(name: str) -> str:
    """The router a `--routers` name runs: itself, or a Tandem router's `@before` variant's."""
    return name.removesuffix(BEFORE)


def slo_name(slo: SLO) -> str:
    return f"{slo.ttft_ms / 1000:g}s/{slo.itl_ms:g}ms"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_table(title: str, rows: dict[str, dict[str, Any]], slos: list[SLO]) -> None:
    print(f"\n{title}")
    goodput_heads = "".join(f" {'good ' + slo_name(s):>15}" for s in slos)
    print(
        f"    {'router':<10} {'TTFT p50':>8} {'p90':>6} {'p99':>6} {'TPOT p50':>8} {'p99':>6}"
        f"{goodput_heads} {'hit rate':>8} {'preempt':>7} {'max/mean':>8} {'failed':>6}"
        f" {'req':>5}"
    )
    for name, row in rows.items():
        goodput = "".join(f" {row['goodput'][slo_name(s)]:15.3f}" for s in slos)
        print(
            f"    {name:<10} {ms(row['ttft_p50']):>8} {ms(row['ttft_p90']):>6} "
            f"{ms(row['ttft_p99']):>6} {row['tpot_p50'] or 0:8.1f} {row['tpot_p99'] or 0:6.1f}"
            f"{goodput} {row['hit_rate']:8.1%} {row['preemptions']:7.0f} "
            f"{row['max_mean_load']:8.2f} {row['failed']:6d} "
            f"{row['requests']:5d}"
        )


def ratios(rows: dict[str, dict[str, Any]], slos: list[SLO]) -> dict[str, dict[str, float]]:
    """Each Tandem mode against the best peer on each figure (`relative` to `best_peer`)."""
    peers = [row for name, row in rows.items() if name in PEER_ROUTERS and row["requests"]]
    tandem = {n: row for n, row in rows.items() if router_kind(n) in TANDEM_ROUTERS and row}
    if not peers or not tandem:
        return {}
    best = best_peer(peers, slos)
    return {name: relative(row, best, slos) for name, row in tandem.items()}


def best_peer(peers: list[dict[str, Any]], slos: list[SLO]) -> dict[str, Any]:
    """The best of the peers figure by figure: the lowest TTFT p50 and p99, the highest goodput
    of each SLO pair."""
    return {
        "ttft_p50": min(p["ttft_p50"] for p in peers if p["ttft_p50"] is not None),
        "ttft_p99": min(p["ttft_p99"] for p in peers if p["ttft_p99"] is not None),
        "goodput": {slo_name(slo): max(p["goodput"][slo_name(slo)] for p in peers) for slo in slos},
    }


def relative(row: dict[str, Any], reference: dict[str, Any], slos: list[SLO]) -> dict[str, float]:
    """A row's TTFT p50/p99 over the reference's (below 1 is better) and its goodput of each SLO
    pair over the reference's (above 1 is better); NaN where either has no figure."""
    figures: dict[str, float] = {}
    for key in ("ttft_p50", "ttft_p99"):
        ref = reference[key]
        figures[key] = row[key] / ref if row[key] is not None and ref else float("nan")
    for slo in slos:
        name = slo_name(slo)
        ref = reference["goodput"][name]
        figures[f"goodput {name}"] = row["goodput"][name] / ref if ref else float("nan")
    return figures


def print_tandem_figures(rows: dict[str, dict[str, Any]]) -> None:
    for name, row in rows.items():
        if "decisions" not in row:
            continue
        decided = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["decisions"].items()))
        mape = ", ".join(f"{k} {v:.1%}" for k, v in sorted(row["prediction_mape"].items()))
        expected = row.get("router_hit_rate")
        hit = f"; index hit rate {expected:.1%}" if expected is not None else ""
        print(f"    {name}: decisions {decided or '-'}{hit}" + (f"; MAPE {mape}" if mape else ""))
        if row.get("passed_over"):
            over = row["passed_over"]
            print(
                f"      hits passed over: {over['placements']:.0f} placements,"
                f" {over['meet'] + over['cost']:.1%} of prompt tokens (below the pick's bar"
                f" {over['meet']:.1%}, dearer {over['cost']:.1%})"
            )
        if row.get("term_mape"):
            terms = ", ".join(f"{k} {v:.1%}" for k, v in sorted(row["term_mape"].items()))
            print(f"      MAPE by term: {terms}")


def print_ratios(found: dict[str, dict[str, float]]) -> None:
    for name, figures in found.items():
        cells = ", ".join(f"{key.replace('_', ' ')} {value:.2f}x" for key, value in figures.items())
        print(f"    {name} vs the best peer: {cells}")


def report_round(
    title: str, rows: Rows, slos: list[SLO], pool_bound: float | None
) -> dict[str, dict[str, float]]:
    """Prints one round's table at one load, Tandem's own figures and its ratios to the best
    peer; returns those ratios."""
    first = next(iter(rows.values()))
    offered = f"{first['offered_rps']:.1f} req/s offered" if first["offered_rps"] else ""
    bound = (
        f", unbounded-cache hit rate {first['bound_hit_rate']:.1%}"
        if first["bound_hit_rate"] is not None
        else ""
    )
    if pool_bound is not None:
        bound += f", one pool-sized LRU cache {pool_bound:.1%}"
    print_table(f"{title} ({offered}{bound}); latencies in ms", rows, slos)
    print_tandem_figures(rows)
    found = ratios(rows, slos)
    print_ratios(found)
    return found


# -- several rounds ------------------------------------------------------------------------------


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The routers in the order of a round: as given in even rounds, reversed in odd ones, so
    that no router always runs first on freshly reset engines or last on a warm machine."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


ROUND_FIGURES = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99", "hit_rate")


def figure(row: dict[str, Any], key: str) -> Any:
    """A row's figure by its key in `round_figures`: one of ROUND_FIGURES, or `goodput PAIR`."""
    if key.startswith("goodput "):
        return row["goodput"][key.removeprefix("goodput ")]
    return row[key]


def spread(values: Sequence[float]) -> Spread:
    return statistics.median(values), min(values), max(values)


def round_figures(rounds: Sequence[Rows], slos: list[SLO]) -> dict[str, dict[str, Spread]]:
    """Per router, each figure's median, lowest and highest over the rounds that measured it."""
    keys = [*ROUND_FIGURES, *(f"goodput {slo_name(slo)}" for slo in slos)]
    out: dict[str, dict[str, Spread]] = {}
    for name in rounds[0]:
        figures: dict[str, Spread] = {}
        for key in keys:
            values = [v for rows in rounds if (v := figure(rows[name], key)) is not None]
            if values:
                figures[key] = spread(values)
        out[name] = figures
    return out


def paired_ratios(rounds: Sequence[Rows], slos: list[SLO]) -> dict[str, dict[str, Spread]]:
    """Ratios taken within each round, then their median and range over the rounds: each Tandem
    router against the best peer (`ratios`), and each `KIND@before` router's KIND against it
    ("KIND vs KIND@before": TTFT p50/p99 over before's, below 1 is better; goodput over
    before's, above 1 is better; hit rate as the difference in points)."""
    per_round: dict[str, dict[str, list[float]]] = {}

    def add(label: str, figures: dict[str, float]) -> None:
        for key, value in figures.items():
            per_round.setdefault(label, {}).setdefault(key, []).append(value)

    for rows in rounds:
        for name, figures in ratios(rows, slos).items():
            add(f"{name} vs the best peer", figures)
        for name in rows:
            before = rows.get(name + BEFORE)
            if before is not None:
                add(f"{name} vs {name}{BEFORE}", against(rows[name], before, slos))
    return {
        label: {key: spread(values) for key, values in figures.items()}
        for label, figures in per_round.items()
    }


def against(row: dict[str, Any], before: dict[str, Any], slos: list[SLO]) -> dict[str, float]:
    """One round's figures of a router relative to its `@before` twin's, and the difference of
    their hit rates in points."""
    points = 100.0 * (row["hit_rate"] - before["hit_rate"])
    return relative(row, before, slos) | {"hit_rate points": points}


def print_rounds(
    count: int, figures: dict[str, dict[str, Spread]], paired: dict[str, dict[str, Spread]]
) -> None:
    print(f"\n    over {count} rounds, median (lowest-highest):")
    for name, by_key in figures.items():
        cells = ", ".join(f"{key.replace('_', ' ')} {cell(key, s)}" for key, s in by_key.items())
        print(f"    {name}: {cells}")
    for label, by_key in paired.items():
        cells = ", ".join(
            f"{key.replace('_', ' ')} {ratio_cell(key, s)}" for key, s in by_key.items()
        )
        print(f"    {label}, per round: {cells}")


def cell(key: str, s: Spread) -> str:
    if key == "hit_rate":
        return f"{s[0]:.1%} ({s[1]:.1%}-{s[2]:.1%})"
    if key.startswith("goodput"):
        return f"{s[0]:.3f} ({s[1]:.3f}-{s[2]:.3f})"
    if key.startswith("tpot"):
        return f"{s[0]:.1f} ({s[1]:.1f}-{s[2]:.1f})"
    return f"{s[0]:.0f} ({s[1]:.0f}-{s[2]:.0f})"


def ratio_cell(key: str, s: Spread) -> str:
    if key.endswith("points"):
        return f"{s[0]:+.1f} ({s[1]:+.1f} to {s[2]:+.1f})"
    return f"{s[0]:.2f}x ({s[1]:.2f}-{s[2]:.2f})"
