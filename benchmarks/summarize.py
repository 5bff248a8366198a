"""Collect every benchmark's markdown table under one results directory into SUMMARY.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summarize(results_dir: Path) -> str:
    """Return one markdown document holding each benchmark's table, in name order."""
    parts = ["# Benchmark summary", ""]
    for bench_dir in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        tables = sorted(bench_dir.glob("*.md"))
        jsons = sorted(bench_dir.glob("*.json"))
        parts.append(f"## {bench_dir.name}")
        parts.append("")
        if not tables:
            parts.append(f"(no table written; JSON files: {[p.name for p in jsons]})")
        for table in tables:
            parts.append(table.read_text().strip())
            parts.append("")
        for path in jsons:
            try:
                json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                parts.append(f"**{path.name} is not valid JSON: {exc}**")
        parts.append("")
    return "\n".join(parts)


def main() -> int:
    """Write SUMMARY.md into the directory given as the only argument and print it."""
    if len(sys.argv) != 2:
        print("usage: summarize.py RESULTS_DIR", file=sys.stderr)
        return 2
    results_dir = Path(sys.argv[1])
    text = summarize(results_dir)
    (results_dir / "SUMMARY.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
