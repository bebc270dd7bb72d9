"""`python -m tandem.observability [--check] [CHART]`: write (or check) the chart's dashboards and rules."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.observability.generate import stale_files, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.observability",
        description="Generate the Grafana dashboards and Prometheus rules into the Helm chart.",
    )
    parser.add_argument("chart", nargs="?", type=Path, default=Path("charts/tandem"))
    parser.add_argument(
        "--check", action="store_true", help="only report files that differ (exit 1 if any)"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.chart)
        for path in stale:
            print(f"{args.chart / path} is out of date", file=sys.stderr)
        return 1 if stale else 0
    for path in write(args.chart):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
