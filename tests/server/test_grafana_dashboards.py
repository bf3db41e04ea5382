"""The Grafana dashboards in examples/grafana/ read series hyserve exports: every metric name in their PromQL
queries is on a real server's /metrics after a request (vLLM's published dashboard, pinned as it is
published, and hyserve's own)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_fixtures import REPO_ROOT, ServerProcess

GRAFANA = REPO_ROOT / "examples" / "grafana"
# vLLM v0.11.0's examples/online_serving/prometheus_grafana/grafana.json, byte for byte
VLLM_DASHBOARD_SHA256 = "36f9bb5fd238cb3cc2494bdcdde277585fa6edaa5e505cedefdd2aba6d39766c"

_PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
    "inf", "nan",
}  # fmt: skip
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (followed by '('),
    keywords, label names (inside {...} or by/without (...)), strings, ranges ([...]) or $variables."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', " ", expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery windows
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # dashboard variables
    names = set()
    for m in _IDENT.finditer(s):
        rest = s[m.end() :].lstrip()
        if rest.startswith("(") or m.group(0).lower() in _PROMQL_KEYWORDS:
            continue
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] == "."):
            continue  # a number's exponent or suffix (1e3)
        names.add(m.group(0))
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every panel target's `expr` (rows' nested panels included)."""
    out: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return out


def exported_sample_names(text: str) -> set[str]:
    """The sample names of a Prometheus text exposition (histograms give _bucket / _sum / _count)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def exported() -> Iterator[set[str]]:
    srv = ServerProcess([]).start()
    try:
        for stream in (False, True):
            body = {"model": "hyserve-tiny", "prompt": "Hello", "max_tokens": 4, "stream": stream}
            r = httpx.post(f"{srv.base_url}/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        yield exported_sample_names(httpx.get(f"{srv.url}/metrics", timeout=10).text)
    finally:
        srv.stop()


def test_the_promql_parser_finds_metric_names_only() -> None:
    expr = (
        'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$m"}'
        "[$__rate_interval]))) / ignoring(instance) rate(hyserve_x_total[5m]) > 1e3 and on (job) up"
    )
    assert promql_metric_names(expr) == {"vllm:e2e_request_latency_seconds_bucket", "hyserve_x_total", "up"}


def test_vllm_dashboard_is_pinned_as_published() -> None:
    data = (GRAFANA / "vllm.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == VLLM_DASHBOARD_SHA256
    assert "v0.11.0" in (GRAFANA / "README.md").read_text()


@pytest.mark.parametrize(("name", "prefix"), [("vllm.json", "vllm:"), ("hyserve.json", "hyserve_")])
def test_every_series_a_dashboard_reads_is_exported(exported: set[str], name: str, prefix: str) -> None:
    queries = dashboard_queries(json.loads((GRAFANA / name).read_text()))
    assert len(queries) >= 14
    used = set().union(*(promql_metric_names(q) for q in queries))
    assert used and all(n.startswith(prefix) for n in used), sorted(used)
    missing = sorted(used - exported)
    assert not missing, f"{name} reads series /metrics does not export: {missing}"


def test_hyserve_dashboard_covers_the_hybrid_series() -> None:
    queries = "\n".join(dashboard_queries(json.loads((GRAFANA / "hyserve.json").read_text())))
    for series in (
        "hyserve_state_slots_used",
        "hyserve_snapshot_slots_used",
        "hyserve_jit_compiles_after_ready_total",
        "hyserve_step_failures_total",
        "hyserve_request_failures_total",
        "hyserve_slow_reader_aborts_total",
    ):
        assert series in queries, series


def test_dashboards_are_grafana_json() -> None:
    for name in ("vllm.json", "hyserve.json"):
        d = json.loads((GRAFANA / name).read_text())
        assert d["panels"] and d["title"] and isinstance(d["templating"]["list"], list)
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), name
