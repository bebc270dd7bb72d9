"""Render the dashboards of docs/observability.md from a few minutes of a live cluster.

    python tests/observability/run_snapshot.py docs/observability

The same set-up as the query-evaluation test (live_cluster.py), with a longer shared-prefix run on
the H200 timing profile so the 5m recording windows fill and the prefix cache has hits.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "autoscaling")]

from live_cluster import CLUSTER, NAMESPACE, live_cluster  # noqa: E402
from shipped import DASHBOARDS  # noqa: E402

from tandem.observability.snapshot import snapshot  # noqa: E402

UP = ["--prefill", "1", "--decode", "2"]
BENCH = ["--preset", "shared-prefix", "--qps", "4", "--num-requests", "720", "--warmup", "0"]


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory() as workdir,
        live_cluster(Path(workdir), UP, BENCH, feed_every_s=10, bench_timeout_s=600) as live,
    ):
        end = time.time()
        variables = {"namespace": NAMESPACE, "cluster": CLUSTER, "__rate_interval": "1m"}
        for path in DASHBOARDS:
            snapshot(path, live.prometheus.url, variables, live.started - 5, end,
                     out / f"{path.stem}.png", {"pod": sorted(live.pods)})  # fmt: skip
        print(f"bench queueing share {live.bench['queue_share']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
