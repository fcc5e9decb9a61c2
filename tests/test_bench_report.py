"""bench/run's report file: the run's report replaces only the report at
the top of bench/RESULTS.md; the sections written by hand after it stay."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_report_replaces_only_the_report_of_a_results_file() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import report
    finally:
        sys.path.pop(0)
    old = "# Benchmark results\n\nold table\n\n## Chaos soak\n\nby hand\n"
    new = report.merged(old, "# Benchmark results\n\nnew table\n")
    assert new == "# Benchmark results\n\nnew table\n\n## Chaos soak\n\nby hand\n"
    assert report.merged("", "R\n") == "R\n"
    assert report.merged("# only a report\n", "R\n") == "R\n"
