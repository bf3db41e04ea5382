"""The repository speaks of the software only: the README stays a short user's guide without dated runs,
docs/architecture.md stays a map a newcomer reads in minutes, and no tracked text file carries the wording of
how the software was being developed (work sessions, tracker numbers, borrowed machines, tool folders)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

README_MAX_LINES = 200
ARCHITECTURE_MAX_WORDS = 2500
PARAGRAPH_MAX_WORDS = 250
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")

_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\w+teenth"
    r"|\w+tieth(?:-\w+)?|\d+(?:st|nd|rd|th))"
)
_QUANTIFIER = r"(?:this|that|next|last|previous|earlier|later|each|every|one|a|the|same)"
# Each pattern names a way the development process leaks into the text. They are precise on purpose:
# `ClientSession`, `requests.Session`, `async with session:` and "an issue of a kernel" pass.
DENYLIST: dict[str, re.Pattern[str]] = {
    "a work session": re.compile(
        rf"\b(?:{_QUANTIFIER}|{_ORDINAL}) sessions?\b|\bsessions? \d+\b|\bdevice sessions?\b", re.I
    ),
    "a tracker number": re.compile(r"\bissues?[ -]#?\d+\b|\bissues? \d+ and \d+\b", re.I),
    "a borrowed machine": re.compile(r"\blent\b|\blent-GPU\b", re.I),
    "a tool's output folder": re.compile(r"\$OUT\b|\$\{OUT\b"),
    "a path outside the repository": re.compile(r"\.\./shared\b"),
    "the people or tools behind the work": re.compile(
        r"\bhelper agents?\b|\bdevice (?:tool|call)s?\b|\bGPU tool\b|\bworkplace\b|\bstop notes?\b", re.I
    ),
    "the people behind the work (CEO)": re.compile(r"\bCEO\b"),
}


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path == Path(__file__).resolve():
            continue
        with path.open("rb") as f:
            head = f.read(8192)
        if b"\0" in head:  # binary: weights, images, archives
            continue
        files.append(path)
    return files


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def test_readme_is_a_short_guide_without_dated_runs() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    dated = [f"README.md:{i}: {line}" for i, line in enumerate(lines, 1) if DATE.search(line)]
    assert not dated, "dated runs belong in docs/performance.md:\n" + "\n".join(dated)


def test_architecture_reads_in_minutes() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    words = len(text.split())
    assert words <= ARCHITECTURE_MAX_WORDS, f"docs/architecture.md has {words} words"
    long = [
        f"{len(p.split())} words: {p[:70]!r}"
        for p in _paragraphs(text)
        if len(p.split()) > PARAGRAPH_MAX_WORDS
    ]
    assert not long, "paragraphs over 250 words in docs/architecture.md:\n" + "\n".join(long)


def test_no_development_process_wording() -> None:
    files = _tracked_text_files()
    assert len(files) > 100, "git ls-files found too few files: run from a git checkout"
    bad = []
    for path in files:
        text = path.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            for what, pattern in DENYLIST.items():
                m = pattern.search(line)
                if m:
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {what}: {m.group(0)!r}")
    if bad:
        print("\n".join(bad))
    assert not bad, f"{len(bad)} lines speak of the development process:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "ok",
    [
        "async with aiohttp.ClientSession() as session:",
        "s = requests.Session()",
        "async with session.post(url) as r:",
        "a group issues its PV and next S product in its turn",
        "the first token, the last block",
        "with sessions of the HTTP client kept alive",
        "OUT_DIR=/tmp/run scripts/gpu_check.sh SHA",
    ],
)
def test_ordinary_words_pass(ok: str) -> None:
    assert not [w for w, p in DENYLIST.items() if p.search(ok)]


@pytest.mark.parametrize(
    "leak",
    [
        "the nineteenth session's run",
        "this session",
        "(issue 23's bar)",
        "issues 24 and 22",
        "issue #6",
        "on the lent H200",
        'cp x "$OUT"/',
        "../shared/tools/gpu_wheels.sh",
        "one device call",
        "the twenty-first session",
    ],
)
def test_process_wording_is_caught(leak: str) -> None:
    assert [w for w, p in DENYLIST.items() if p.search(leak)]
