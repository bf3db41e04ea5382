"""Keep only the newest result per record and GPU in benchmarks/results/ (the rule is in results_index.py).

Prints one row per series and GPU: the files kept and the files a newer result supersedes; `--apply`
deletes the superseded files and folders (git history keeps them).

    python -m benchmarks.prune_results [--apply] [--folder benchmarks/results]
"""

from __future__ import annotations

import argparse
import shutil
from collections import defaultdict
from pathlib import Path

from benchmarks.results_index import Entry, ResultsIndex, index_results

ROOT = Path(__file__).resolve().parents[1]


def table(index: ResultsIndex) -> list[str]:
    """Markdown rows: series (with its record count), GPU, kept files, superseded files."""
    gone = {e.name for e in index.superseded_entries}
    groups: dict[tuple[str, str], list[Entry]] = defaultdict(list)
    for e in index.entries:
        groups[(e.series, e.gpu)].append(e)
    rows = ["| record | GPU | kept | superseded |", "| --- | --- | --- | --- |"]
    for (series, gpu), entries in sorted(groups.items()):
        records = len({r for e in entries for r in e.records})
        label = f"{series} ({records} records)" if records > 1 else series
        kept = [f for e in entries if e.name not in gone for f in e.files]
        superseded = [f for e in entries if e.name in gone for f in e.files]
        rows.append(f"| {label} | {gpu} | {', '.join(kept) or '-'} | {', '.join(superseded) or '-'} |")
    return rows


def delete(folder: Path, names: list[str]) -> None:
    for name in names:
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        print(f"deleted {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--apply", action="store_true", help="delete the superseded files and folders")
    args = ap.parse_args(argv)
    index = index_results(args.folder)
    print("\n".join(table(index)))
    superseded = index.superseded
    print(f"\n{len(index.entries)} results, {len(superseded)} superseded files")
    if args.apply:
        delete(args.folder, superseded)
    elif superseded:
        print("run with --apply to delete them")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
