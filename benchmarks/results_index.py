"""Which files of benchmarks/results/ are current: the rule that the folder keeps only the newest result per
record and GPU, shared by tests/unit/test_results_folder.py and `python -m benchmarks.prune_results`.

Entries. Each JSON object is one result entry, and every other file whose name is its stem followed by "."
or "_" (its `.md` table, `.png` / `_latency.png` plots, `.log`, a `_config.json` that carries none of
`records`, `date`, `git_sha`, `gpu`) is a side file that goes with it. Every other file or folder (logs,
text, folders of runs) is an entry of its own.

Records. A result whose `records` carry names holds one record per name, qualified by its series: the file
name's part before the date / short commit (`model` for `model_2026-12-01_f73cf84.json`,
`model-NVIDIA-Nemotron-3-Nano-30B-A3B-BF16` for that model's files), since the same record names appear
for several models. Any other entry holds one record named after its file: the name with its date, commit
and GPU tag taken out (`gpu_check_longprompt` for `gpu_check_2026-12-04_e98a196_longprompt.log`); there the
words after the commit are kept, as nothing else says what the file holds.

GPU. The JSON's `gpu`, else an `h100` / `h200` / `cpu` tag in the name, else the GPU a text file or a
folder's files name (most often), else "unknown"; "NVIDIA H200" and "h200" are the same GPU.

Order. By the date (the JSON's `date`, else the one in the name, else the commit's), ties by the commit's
time in git, then by the full timestamp. An entry is superseded when every (record, GPU) it holds is also
held by a strictly newer entry; it goes with its side files. An entry with no date is never superseded.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

CommitTime = Callable[[str], "int | None"]

_DATE = re.compile(r"^20\d\d-[01]\d-[0-3]\d$")
_SHA = re.compile(r"^(?=[0-9a-f]*\d)([0-9a-f]{7,40})(?:[-+](.*))?$")
_GPU = re.compile(r"\b(gh200|gb200|b200|b100|h200|h100|h800|h20|a100|a10g|l40s|l4)\b", re.I)
_NVIDIA = re.compile(r"NVIDIA ([A-Za-z0-9]+)")
_RESULT_KEYS = ("records", "date", "git_sha", "gpu")
_TEXT_SUFFIXES = (".log", ".txt", ".md", ".json", ".yml", ".yaml")
_SCAN_CHARS = 200_000


@dataclass(frozen=True)
class NameParts:
    """A result file's name split at its date and short commit (tokens joined by "_")."""

    head: str  # the part before the date / commit, GPU tags taken out
    tail: str  # the words after them, GPU tags taken out
    date: str | None
    sha: str | None
    gpu: str | None

    @property
    def series(self) -> str:
        """The record name of a file with no named records: its name without date, commit and GPU tag."""
        return "_".join(p for p in (self.head, self.tail) if p)


@dataclass(frozen=True)
class Entry:
    """One result in the folder: a JSON result with its side files, or a file or folder of its own."""

    name: str
    series: str
    records: frozenset[str]
    gpu: str
    date: str | None
    sha: str | None
    side_files: tuple[str, ...]
    order: tuple[str, int, str] | None

    @property
    def keys(self) -> frozenset[tuple[str, str]]:
        return frozenset((r, self.gpu) for r in self.records)

    @property
    def files(self) -> tuple[str, ...]:
        return (self.name, *self.side_files)


@dataclass(frozen=True)
class ResultsIndex:
    entries: tuple[Entry, ...]
    superseded_entries: tuple[Entry, ...]

    @property
    def superseded(self) -> list[str]:
        """Every superseded file or folder (entries and their side files), by name, sorted."""
        return sorted(f for e in self.superseded_entries for f in e.files)

    def kept(self) -> tuple[Entry, ...]:
        gone = {e.name for e in self.superseded_entries}
        return tuple(e for e in self.entries if e.name not in gone)


def normalise_gpu(text: str) -> str | None:
    """ "NVIDIA H200", "h200" and "NVIDIA H200, driver ..." -> "h200"; CPU notes -> "cpu"; else None."""
    m = _GPU.search(text)
    if m:
        return m.group(1).lower()
    low = text.strip().lower()
    if re.search(r"\bcpu\b", low) or low.startswith("none"):
        return "cpu"
    return None


def split_name(stem: str) -> NameParts:
    """Split a file stem (tokens joined by "_") at its first date or short-commit token."""
    head: list[str] = []
    tail: list[str] = []
    date = sha = gpu = None
    for token in stem.split("_"):
        m = _SHA.match(token)
        if date is None and _DATE.match(token):
            date = token
        elif sha is None and m:
            sha = m.group(1)
            if m.group(2):
                tail.append(m.group(2))
        elif token.lower() == "cpu" or (_GPU.fullmatch(token) is not None):
            gpu = gpu or token.lower()
        else:
            (tail if date or sha else head).append(token)
    return NameParts("_".join(head), "_".join(tail), date, sha, gpu)


def git_commit_time(repo: Path) -> CommitTime:
    """A lookup of a short commit's committer time (Unix seconds) in `repo`'s git; None when unknown."""
    cache: dict[str, int | None] = {}
    has_git = shutil.which("git") is not None

    def lookup(sha: str) -> int | None:
        if sha not in cache:
            cache[sha] = None
            if has_git:
                try:
                    r = subprocess.run(
                        ["git", "-C", str(repo), "show", "-s", "--format=%ct", f"{sha}^{{commit}}"],
                        capture_output=True,
                        text=True,
                        timeout=10,
                    )
                except (OSError, subprocess.SubprocessError):
                    return None
                if r.returncode == 0 and r.stdout.strip().isdigit():
                    cache[sha] = int(r.stdout.strip())
        return cache[sha]

    return lookup


def _load_json(path: Path) -> dict[str, object] | None:
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _is_result(doc: dict[str, object]) -> bool:
    return any(k in doc for k in _RESULT_KEYS)


def _record_names(doc: dict[str, object]) -> frozenset[str]:
    records = doc.get("records")
    if not isinstance(records, list):
        return frozenset()
    return frozenset(r["name"] for r in records if isinstance(r, dict) and isinstance(r.get("name"), str))


def _gpu_in_texts(texts: Iterable[str]) -> str | None:
    """The GPU the texts name most often: "NVIDIA <model>" first, else a bare "H100" / "h200"."""
    named: Counter[str] = Counter()
    bare: Counter[str] = Counter()
    for text in texts:
        named.update(g for m in _NVIDIA.finditer(text) if (g := normalise_gpu(m.group(1))) and g != "cpu")
        bare.update(m.group(1).lower() for m in _GPU.finditer(text))
    for counts in (named, bare):
        if counts:
            return counts.most_common(1)[0][0]
    return None


def _texts(path: Path) -> list[str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = []
    for f in files:
        if f.suffix in _TEXT_SUFFIXES:
            try:
                out.append(f.read_text(errors="replace")[:_SCAN_CHARS])
            except OSError:
                continue
    return out


def _folder_gpu_and_date(path: Path) -> tuple[str | None, str | None]:
    """The most common GPU of the JSON results inside a folder, and their newest date."""
    gpus: Counter[str] = Counter()
    dates = []
    for f in sorted(path.rglob("*.json")):
        doc = _load_json(f)
        if doc is None or not _is_result(doc):
            continue
        gpu, date = doc.get("gpu"), doc.get("date")
        if isinstance(gpu, str):
            gpus[_gpu_name(gpu)] += 1
        if isinstance(date, str):
            dates.append(date)
    return (gpus.most_common(1)[0][0] if gpus else None), (max(dates) if dates else None)


def _gpu_name(text: str) -> str:
    found = normalise_gpu(text)
    if found:
        return found
    low = re.sub(r"^nvidia\s+", "", text.strip().lower())
    return low or "unknown"


def _commit_date(sha: str | None, commit_time: CommitTime) -> str | None:
    t = commit_time(sha) if sha else None
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat() if t is not None else None


def _order(date: str | None, sha: str | None, commit_time: CommitTime) -> tuple[str, int, str] | None:
    if not date:
        return None
    t = commit_time(sha) if sha else None
    return (date[:10], t if t is not None else -1, date)


def _result_entry(
    path: Path, doc: dict[str, object], sides: tuple[str, ...], commit_time: CommitTime
) -> Entry:
    parts = split_name(path.stem)
    names = _record_names(doc)
    series = parts.head or parts.series
    records = frozenset(f"{series}: {n}" for n in names) if names else frozenset({parts.series})
    gpu_field = doc.get("gpu")
    gpu = _gpu_name(gpu_field) if isinstance(gpu_field, str) else (parts.gpu or "unknown")
    sha_field = doc.get("git_sha")
    m = _SHA.match(sha_field.split("_")[0]) if isinstance(sha_field, str) else None
    sha = m.group(1) if m else parts.sha
    date_field = doc.get("date")
    date = date_field if isinstance(date_field, str) else parts.date or _commit_date(sha, commit_time)
    return Entry(
        name=path.name,
        series=series if names else parts.series,
        records=records,
        gpu=gpu,
        date=date,
        sha=sha,
        side_files=sides,
        order=_order(date, sha, commit_time),
    )


def _plain_entry(path: Path, commit_time: CommitTime) -> Entry:
    parts = split_name(path.name if path.is_dir() else path.stem)
    folder_gpu, folder_date = _folder_gpu_and_date(path) if path.is_dir() else (None, None)
    gpu = parts.gpu or folder_gpu or _gpu_in_texts(_texts(path)) or "unknown"
    date = parts.date or folder_date or _commit_date(parts.sha, commit_time)
    return Entry(
        name=path.name,
        series=parts.series,
        records=frozenset({parts.series}),
        gpu=gpu,
        date=date,
        sha=parts.sha,
        side_files=(),
        order=_order(date, parts.sha, commit_time),
    )


def _side_files(names: list[str], result_stems: list[str]) -> dict[str, list[str]]:
    """Each result stem's side files: names that extend the stem with "." or "_" (the longest stem wins)."""
    by_stem: dict[str, list[str]] = {s: [] for s in result_stems}
    longest_first = sorted(result_stems, key=len, reverse=True)
    for name in names:
        for stem in longest_first:
            if name.startswith(stem + ".") or name.startswith(stem + "_"):
                by_stem[stem].append(name)
                break
    return by_stem


def superseded_entries(entries: Iterable[Entry]) -> tuple[Entry, ...]:
    """Entries every (record, GPU) pair of which a strictly newer entry also holds."""
    entries = tuple(entries)
    newest: dict[tuple[str, str], tuple[str, int, str]] = {}
    for e in entries:
        if e.order is None:
            continue
        for k in e.keys:
            if k not in newest or e.order > newest[k]:
                newest[k] = e.order
    return tuple(
        e for e in entries if e.order is not None and e.keys and all(newest[k] > e.order for k in e.keys)
    )


def index_results(folder: Path, commit_time: CommitTime | None = None) -> ResultsIndex:
    """Read every file and folder directly in `folder` into entries, and find the superseded ones."""
    lookup = commit_time if commit_time is not None else git_commit_time(folder)
    paths = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    docs = {p.name: doc for p in paths if (doc := _load_json(p)) is not None}
    all_stems = [Path(n).stem for n in docs]
    # a JSON object without result keys that extends another JSON's stem (a `_config.json`) is a side file
    results = {
        n: d
        for n, d in docs.items()
        if _is_result(d) or not any(n.startswith(s + "_") for s in all_stems if s != Path(n).stem)
    }
    stems = [Path(n).stem for n in results]
    others = [p.name for p in paths if p.name not in results and p.is_file()]
    sides = _side_files(others, stems)
    side_names = {n for names in sides.values() for n in names}
    entries = [
        _result_entry(folder / name, doc, tuple(sorted(sides[Path(name).stem])), lookup)
        for name, doc in results.items()
    ]
    entries += [_plain_entry(p, lookup) for p in paths if p.name not in results and p.name not in side_names]
    entries.sort(key=lambda e: e.name)
    return ResultsIndex(tuple(entries), superseded_entries(entries))
