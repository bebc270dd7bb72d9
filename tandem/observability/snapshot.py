"""A PNG of a dashboard drawn with matplotlib from the dashboard's own queries, for docs and runs
where Grafana itself is not at hand: each panel is a subplot of its targets' range queries.

    python -m tandem.observability.snapshot charts/tandem/dashboards/cluster-overview.json \\
        --prometheus http://127.0.0.1:9090 --var namespace=default --var cluster=llama-8b \\
        --minutes 10 --out cluster-overview.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, PercentFormatter

Series = tuple[str, list[float], list[float]]  # legend, unix times, values


def interpolate(expr: str, variables: Mapping[str, str]) -> str:
    """Grafana's `$name` interpolation (longest names first, so `$pod` never eats `$podx`)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${name}", variables[name])
    return expr


def legend(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def panels(model: Mapping[str, Any], repeats: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """The dashboard's non-row panels in order, rows with `repeat` expanded once per value
    (each copy's `vars` holds the repeated variable's value)."""
    out: list[dict[str, Any]] = []
    repeat: str | None = None
    block: list[dict[str, Any]] = []

    def flush() -> None:
        values = repeats.get(repeat, []) if repeat else [None]
        for value in values:
            for panel in block:
                copy = dict(panel, vars={repeat: value} if repeat and value else {})
                if repeat and value:
                    copy["title"] = f"{value}: {panel['title']}"
                out.append(copy)

    for panel in model["panels"]:
        if panel["type"] == "row":
            flush()
            repeat, block = panel.get("repeat"), []
        else:
            block.append(panel)
    flush()
    return out


def query_range(
    prometheus: str, expr: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{prometheus.rstrip('/')}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step},
        timeout=30,
    )
    body = response.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return list(body["data"]["result"])


def fetch(
    prometheus: str,
    panel: Mapping[str, Any],
    variables: Mapping[str, str],
    start: float,
    end: float,
    step: float,
) -> list[Series]:
    found: list[Series] = []
    for target in panel["targets"]:
        expr = interpolate(target["expr"], {**variables, **panel.get("vars", {})})
        for item in query_range(prometheus, expr, start, end, step):
            times = [float(t) for t, _ in item["values"]]
            values = [float(v) for _, v in item["values"]]
            found.append((legend(target.get("legendFormat", ""), item["metric"]), times, values))
    return found


def draw(
    title: str, drawn: Sequence[tuple[Mapping[str, Any], list[Series]]], out: Path, columns: int = 3
) -> None:
    """One subplot per panel (time in seconds from the first sample), saved as a PNG."""
    rows = max(1, math.ceil(len(drawn) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.3 * rows), squeeze=False)
    t0 = min((s[1][0] for _, series in drawn for s in series if s[1]), default=0.0)
    for ax, (panel, series) in zip(axes.flat, drawn, strict=False):
        ax.set_title(panel["title"], fontsize=9)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit == "s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1e3:g} ms"))
        for name, times, values in series:
            ax.plot([t - t0 for t in times], values, label=name or None, linewidth=1.2)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        if any(name for name, _, _ in series):
            ax.legend(fontsize=6, loc="upper left")
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.set_visible(False)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out, dpi=80)
    plt.close(figure)


def snapshot(
    dashboard: Path,
    prometheus: str,
    variables: Mapping[str, str],
    start: float,
    end: float,
    out: Path,
    repeats: Mapping[str, Sequence[str]] | None = None,
) -> None:
    model = json.loads(dashboard.read_text())
    step = max(1.0, (end - start) / 240)
    drawn = [
        (panel, fetch(prometheus, panel, variables, start, end, step))
        for panel in panels(model, repeats or {})
    ]
    draw(model["title"], drawn, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.observability.snapshot")
    parser.add_argument("dashboard", type=Path)
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--repeat", action="append", default=[], metavar="NAME=V1,V2", help="row repeat values"
    )
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    variables = dict(v.split("=", 1) for v in args.var) | {"__rate_interval": "1m"}
    repeats = {k: v.split(",") for k, v in (r.split("=", 1) for r in args.repeat)}
    end = time.time()
    snapshot(
        args.dashboard, args.prometheus, variables, end - 60 * args.minutes, end, args.out, repeats
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
