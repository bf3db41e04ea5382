"""benchmarks/results/ keeps only the newest result per record and GPU (benchmarks/results_index.py): no file
there is superseded, the rule holds on a synthetic folder, and no relative markdown link is broken."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from benchmarks.prune_results import main as prune_main
from benchmarks.results_index import index_results, normalise_gpu, split_name

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _no_git(_sha: str) -> int | None:
    return None


def _result(folder: Path, name: str, date: str, gpu: str, records: list[str], sha: str = "0000000") -> None:
    doc = {
        "date": date,
        "git_sha": sha,
        "gpu": gpu,
        "command": "x",
        "records": [{"name": r} for r in records],
    }
    (folder / name).write_text(json.dumps(doc))


def test_results_folder_holds_no_superseded_file() -> None:
    index = index_results(ROOT / "benchmarks" / "results")
    assert index.entries
    assert index.superseded == [], (
        f"superseded results (python -m benchmarks.prune_results --apply deletes them): {index.superseded}"
    )


def test_newer_result_supersedes_older_with_its_side_files(tmp_path: Path) -> None:
    _result(tmp_path, "model_2026-12-01_aaaaaa1.json", "2026-12-01T10:00:00+00:00", "NVIDIA H200", ["a", "b"])
    (tmp_path / "model_2026-12-01_aaaaaa1.md").write_text("| a | b |\n")
    (tmp_path / "model_2026-12-01_aaaaaa1_latency.png").write_bytes(b"\x89PNG")
    _result(tmp_path, "model_2026-12-03_bbbbbb2.json", "2026-12-03T10:00:00+00:00", "h200", ["a", "b", "c"])
    index = index_results(tmp_path, _no_git)
    assert index.superseded == [
        "model_2026-12-01_aaaaaa1.json",
        "model_2026-12-01_aaaaaa1.md",
        "model_2026-12-01_aaaaaa1_latency.png",
    ]
    (kept,) = index.kept()
    assert kept.name == "model_2026-12-03_bbbbbb2.json" and kept.gpu == "h200"


def test_other_gpu_and_unshared_record_and_other_series_are_kept(tmp_path: Path) -> None:
    _result(tmp_path, "model_2026-12-01_aaaaaa1_h100.json", "2026-12-01", "NVIDIA H100 80GB HBM3", ["a"])
    _result(tmp_path, "model_2026-12-01_aaaaaa2.json", "2026-12-01", "NVIDIA H200", ["a", "only-here"])
    _result(tmp_path, "model-Other-30B_2026-12-01_aaaaaa3.json", "2026-12-01", "NVIDIA H200", ["a"])
    _result(tmp_path, "model_2026-12-04_bbbbbb4.json", "2026-12-04", "NVIDIA H200", ["a"])
    index = index_results(tmp_path, _no_git)
    assert index.superseded == []
    by_name = {e.name: e for e in index.entries}
    assert by_name["model_2026-12-01_aaaaaa1_h100.json"].gpu == "h100"
    assert by_name["model-Other-30B_2026-12-01_aaaaaa3.json"].series == "model-Other-30B"


def test_config_json_is_a_side_file_and_a_result_extending_a_stem_is_not(tmp_path: Path) -> None:
    (tmp_path / "train_h200_aaaaaa1.json").write_text(json.dumps({"tag": "train", "loss": 1.0}))
    (tmp_path / "train_h200_aaaaaa1_config.json").write_text(json.dumps({"hidden_size": 8}))
    _result(tmp_path, "bench_2026-12-01_aaaaaa1_ab.json", "2026-12-01T10:00:00", "h200", ["a"])
    _result(tmp_path, "bench_2026-12-01_aaaaaa1_ab_c.json", "2026-12-01T11:00:00", "h200", ["a"])
    index = index_results(tmp_path, _no_git)
    by_name = {e.name: e for e in index.entries}
    assert by_name["train_h200_aaaaaa1.json"].side_files == ("train_h200_aaaaaa1_config.json",)
    assert by_name["train_h200_aaaaaa1.json"].gpu == "h200"
    assert index.superseded == ["bench_2026-12-01_aaaaaa1_ab.json"]


def test_logs_and_folders_are_named_after_their_files(tmp_path: Path) -> None:
    (tmp_path / "gpu_check_2026-12-01_aaaaaa1.log").write_text("NVIDIA H200, 143771 MiB\n")
    (tmp_path / "gpu_check_2026-12-02_aaaaaa2.log").write_text("name\nNVIDIA H200, 143771 MiB\n")
    (tmp_path / "gpu_check_2026-12-01_aaaaaa3_longprompt.log").write_text("NVIDIA H200\n")
    (tmp_path / "gpu_check_aaaaaa4_h100.log").write_text("NVIDIA H100 80GB HBM3; the H200's peaks\n")
    (tmp_path / "gpu_tests_2026-12-01_aaaaaa5.log").write_text("3 passed\n")
    (tmp_path / "gpu_tests_2026-12-02_aaaaaa6.log").write_text("NVIDIA H200\n")
    (tmp_path / "serve_2026-12-01_sweep").mkdir()
    _result(tmp_path / "serve_2026-12-01_sweep", "serve_c1.json", "2026-12-01", "NVIDIA H200", ["r"])
    (tmp_path / "serve_2026-12-03").mkdir()
    index = index_results(tmp_path, lambda sha: 1_700_000_000 if sha == "aaaaaa4" else None)
    by_name = {e.name: e for e in index.entries}
    assert by_name["gpu_check_aaaaaa4_h100.log"].gpu == "h100"
    assert by_name["gpu_check_aaaaaa4_h100.log"].date is not None  # the commit's date
    assert by_name["gpu_tests_2026-12-01_aaaaaa5.log"].gpu == "unknown"
    assert by_name["serve_2026-12-01_sweep"].series == "serve_sweep"
    assert by_name["serve_2026-12-01_sweep"].gpu == "h200"
    assert index.superseded == ["gpu_check_2026-12-01_aaaaaa1.log"]


def test_same_day_ties_go_by_commit_time(tmp_path: Path) -> None:
    _result(tmp_path, "k_aaaaaa1.json", "2026-12-01", "h200", ["a"], sha="aaaaaa1")
    _result(tmp_path, "k_bbbbbb2.json", "2026-12-01", "h200", ["a"], sha="bbbbbb2")
    times = {"aaaaaa1": 200, "bbbbbb2": 100}
    assert index_results(tmp_path, times.get).superseded == ["k_bbbbbb2.json"]
    assert index_results(tmp_path, _no_git).superseded == []  # no way to order them: both stay


def test_prune_deletes_only_with_apply(tmp_path: Path) -> None:
    _result(tmp_path, "m_2026-12-01_aaaaaa1.json", "2026-12-01", "h200", ["a"])
    (tmp_path / "m_2026-12-01_aaaaaa1.md").write_text("t\n")
    (tmp_path / "m_2026-12-02_aaaaaa2").mkdir()
    (tmp_path / "m_2026-12-02_aaaaaa2" / "log.txt").write_text("NVIDIA H200\n")
    (tmp_path / "m_2026-12-03_aaaaaa3").mkdir()
    (tmp_path / "m_2026-12-03_aaaaaa3" / "log.txt").write_text("NVIDIA H200\n")
    _result(tmp_path, "m_2026-12-05_aaaaaa4.json", "2026-12-05", "h200", ["a"])
    assert prune_main(["--folder", str(tmp_path)]) == 0
    assert len(list(tmp_path.iterdir())) == 5
    assert prune_main(["--folder", str(tmp_path), "--apply"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m_2026-12-03_aaaaaa3", "m_2026-12-05_aaaaaa4.json"]


def test_gpu_names_and_file_names() -> None:
    assert normalise_gpu("NVIDIA H200") == normalise_gpu("h200") == "h200"
    assert normalise_gpu("NVIDIA H100 80GB HBM3") == "h100"
    assert normalise_gpu("NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130") == "h200"
    assert normalise_gpu("none (host timing on the CPU)") == normalise_gpu("cpu") == "cpu"
    assert normalise_gpu("something else") is None
    parts = split_name("model-NVIDIA-Nemotron-3-Super-120B-A12B-BF16-fp8_2026-12-05_1b0f1df_h200")
    assert (parts.head, parts.date, parts.sha, parts.gpu) == (
        "model-NVIDIA-Nemotron-3-Super-120B-A12B-BF16-fp8",
        "2026-12-05",
        "1b0f1df",
        "h200",
    )
    assert split_name("gpu_check_2026-12-03_4cf2fba-tests").series == "gpu_check_tests"
    assert split_name("sweep_1719593").sha == "1719593"
    assert split_name("needle_train_cpu_seed0").series == "needle_train_seed0"


def _relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(errors="replace"))
    targets = (m.group(1).split("#")[0] for m in _LINK.finditer(text))
    return [t for t in targets if t and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t)]


def test_no_broken_relative_markdown_links() -> None:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    broken = [
        f"{name}: {target}"
        for name in out.stdout.split()
        if (ROOT / name).is_file()
        for target in _relative_links(ROOT / name)
        if not (ROOT / name).parent.joinpath(target).exists()
    ]
    assert broken == []
