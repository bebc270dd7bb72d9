"""The baseline store: find a stored record comparable with a run and flag what got worse."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from tandem.bench.records import BenchRecord, Summary

Better = Literal["lower", "higher"]

# (name, how to read it from a summary, which direction is better)
METRICS: list[tuple[str, Callable[[Summary], float | None], Better]] = [
    ("TTFT p50 ms", lambda s: s.ttft_ms.p50, "lower"),
    ("TTFT p99 ms", lambda s: s.ttft_ms.p99, "lower"),
    ("ITL p50 ms", lambda s: s.itl_ms.p50, "lower"),
    ("ITL p99 ms", lambda s: s.itl_ms.p99, "lower"),
    ("E2E p50 ms", lambda s: s.e2e_ms.p50, "lower"),
    ("E2E p99 ms", lambda s: s.e2e_ms.p99, "lower"),
    ("requests/s", lambda s: s.request_rate, "higher"),
    ("output tok/s", lambda s: s.output_tok_s, "higher"),
    ("goodput req/s", lambda s: s.goodput_rps, "higher"),
    ("SLO attainment", lambda s: s.slo_attainment, "higher"),
]


class Change(BaseModel):
    """One metric of a run against its baseline; `worse_by` is the relative loss (negative: gain)."""

    metric: str
    baseline: float
    current: float
    ratio: float  # current / baseline
    worse_by: float
    regression: bool


def compare(current: Summary, baseline: Summary, tolerance: float = 0.10) -> list[Change]:
    """Every metric known in both summaries; a regression is a loss larger than `tolerance`.

    worse_by = (current - baseline) / baseline for lower-is-better metrics and
    (baseline - current) / baseline for higher-is-better ones.
    """
    changes = []
    for name, read, better in METRICS:
        old, new = read(baseline), read(current)
        if old is None or new is None or old == 0:
            continue
        worse_by = (new - old) / old if better == "lower" else (old - new) / old
        changes.append(
            Change(
                metric=name,
                baseline=old,
                current=new,
                ratio=new / old,
                worse_by=worse_by,
                regression=worse_by > tolerance,
            )
        )
    return changes


def _records_under(path: Path) -> list[BenchRecord]:
    records = []
    for file in sorted(path.rglob("*.json")):
        try:
            records.append(BenchRecord.load(file))
        except (ValidationError, ValueError, OSError):
            continue  # other JSON files (A/B summaries, foreign files) are not records
    return records


def find_baseline(path: Path, current: BenchRecord) -> BenchRecord:
    """`path` itself when it is a record file; under a directory, the newest record of the same
    workload (spec and seed) and label, or failing that of the same workload, other than `current`."""
    if path.is_file():
        return BenchRecord.load(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no baseline record or store at {path}")
    same_workload = [
        r
        for r in _records_under(path)
        if r.workload == current.workload and r.run_id != current.run_id
    ]
    same_label = [r for r in same_workload if r.label == current.label]
    candidates = same_label or same_workload
    if not candidates:
        raise FileNotFoundError(
            f"no record under {path} ran the same workload ({current.workload.kind}, seed {current.seed})"
        )
    return max(candidates, key=lambda r: r.created_at)


def store(record_path: Path, store_dir: Path) -> Path:
    """Copy a record into a baseline store directory, named by its run id."""
    store_dir.mkdir(parents=True, exist_ok=True)
    target = store_dir / f"{BenchRecord.load(record_path).run_id}.json"
    shutil.copyfile(record_path, target)
    return target
