"""Models named by Hugging Face Hub ids, served offline from a pre-populated Hub cache (`$HF_HOME/hub`, the
layout huggingface_hub writes: `models--org--name/snapshots/<commit>/...` and `refs/<branch>`), and several
served model names (vLLM's --served-model-name a b)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hyserve import envs
from hyserve.hub import CONFIG_PATTERNS, WEIGHT_PATTERNS, is_hub_id, resolve_model
from hyserve.model.tiny import make_tiny
from tests.server_fixtures import REPO_ROOT, ServerProcess

REPO = "hyserve-test/tiny-nemotron"
MAIN_SHA = "a" * 40
V2_SHA = "b" * 40


def add_snapshot(hub: Path, repo: str, sha: str, ref: str | None) -> Path:
    """A snapshot of `repo` at commit `sha` in the Hub cache `hub` (the tiny checkpoint), named by `ref`."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / sha
    make_tiny(snap)
    if ref is not None:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(sha)
    return snap


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    add_snapshot(home / "hub", REPO, MAIN_SHA, "main")
    snap = add_snapshot(home / "hub", REPO, V2_SHA, "v2")
    # revision v2 is told apart by its generation config's recommendation
    (snap / "generation_config.json").write_text('{"max_new_tokens": 3}')
    return home


@pytest.fixture
def offline_cache(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(envs, "HF_HUB_CACHE", hf_home / "hub")
    monkeypatch.setattr(envs, "HF_HUB_OFFLINE", True)
    return hf_home / "hub"


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


# ---- resolving a model name ----------------------------------------------------------------------------


def test_a_hub_id_resolves_to_its_cached_snapshot_and_revision(offline_cache: Path) -> None:
    src = resolve_model(REPO, log=lambda s: None)
    assert src.path == offline_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN_SHA
    assert src.name == REPO and src.hub_id == REPO
    assert resolve_model(REPO, revision="v2", log=lambda s: None).path.name == V2_SHA
    assert resolve_model(REPO, revision=V2_SHA, log=lambda s: None).path.name == V2_SHA


def test_download_dir_is_the_cache_it_reads(offline_cache: Path, tmp_path: Path) -> None:
    add_snapshot(tmp_path / "dl", "other/model", MAIN_SHA, "main")
    src = resolve_model("other/model", download_dir=str(tmp_path / "dl"), log=lambda s: None)
    assert src.path.is_relative_to(tmp_path / "dl") and src.name == "other/model"
    with pytest.raises(ValueError, match="'other/model'.*not in the Hub cache"):
        resolve_model("other/model", log=lambda s: None)  # not in the default cache


def test_a_local_directory_wins_over_a_hub_id(
    offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / REPO
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    src = resolve_model(REPO, log=lambda s: None)
    assert src.path == Path(REPO) and src.hub_id is None and src.name == "tiny-nemotron"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "missing-org/missing-model",
            r"'missing-org/missing-model' \(revision main\) is not in the Hub cache.*"
            r"HF_HUB_OFFLINE is set.*hf download missing-org/missing-model",
        ),
        ("/no/such/dir", r"'/no/such/dir' is not a local directory, nor a Hugging Face Hub id"),
        ("org--x/y", r"'org--x/y' is not a local directory, nor a Hugging Face Hub id"),
        ("a/b/c", r"nor a Hugging Face Hub id \(`org/name`.*at most 96 characters\)"),
        ("o/" + "m" * 100, r"at most 96 characters"),
    ],
)
def test_a_model_that_cannot_be_found_is_named_with_what_to_do(
    offline_cache: Path, model: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_model(model, log=lambda s: None)


def test_a_missing_revision_is_named(offline_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"'hyserve-test/tiny-nemotron' \(revision v9\) is not in the Hub"):
        resolve_model(REPO, revision="v9", log=lambda s: None)


def test_hub_ids_are_told_from_paths() -> None:
    assert is_hub_id("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16") and is_hub_id("gpt2")
    for bad in ("a/b/c", "-x/y", "x/y.", "x..y/z", "x/y--z", "", "x/ y"):
        assert not is_hub_id(bad), bad


def test_only_the_files_serving_reads_are_downloaded() -> None:
    from huggingface_hub.utils import filter_repo_objects

    repo_files = [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "hf_quant_config.json",
        "pytorch_model.bin", "pytorch_model.bin.index.json", "model.gguf", "README.md", "images/arch.png",
        "nemotron_reasoning_parser.py", "original/consolidated.pth",
    ]  # fmt: skip
    wanted = set(filter_repo_objects(repo_files, allow_patterns=[*CONFIG_PATTERNS, *WEIGHT_PATTERNS]))
    assert wanted == set(repo_files[:10])
    no_weights = set(filter_repo_objects(repo_files, allow_patterns=list(CONFIG_PATTERNS)))
    assert not any(f.endswith(".safetensors") for f in no_weights) and "config.json" in no_weights


def test_llm_takes_a_hub_id(offline_cache: Path) -> None:
    from hyserve import LLM, SamplingParams

    with LLM(REPO, revision="v2") as llm:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
        assert llm.engine.loaded.name == REPO  # the served name defaults to the id


# ---- through `hyserve serve` ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_server(hf_home: Path) -> Iterator[ServerProcess]:
    with pytest.MonkeyPatch.context() as mp:  # the server process inherits this environment
        for k in [k for k in os.environ if k.startswith("HF_")]:
            mp.delenv(k)
        mp.setenv("HF_HOME", str(hf_home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        srv = ServerProcess([REPO, "--revision", "v2", "--served-model-name", "tiny", "tiny-alias"]).start()
    yield srv
    srv.stop()


def test_serve_a_hub_id_under_several_names(hub_server: ServerProcess) -> None:
    url = hub_server.base_url
    models = httpx.get(f"{url}/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert httpx.get(f"{url}/models/tiny-alias", timeout=10).json()["id"] == "tiny-alias"
    for name in ("tiny", "tiny-alias", REPO):  # any served name, or the id it was given as
        r = httpx.post(f"{url}/completions", json={"model": name, "prompt": "Hi"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "tiny"  # the first name is the one reported
        assert body["usage"]["completion_tokens"] <= 3  # revision v2's generation_config: max_new_tokens 3
    r = httpx.post(f"{url}/completions", json={"model": "other", "prompt": "Hi"}, timeout=10)
    assert r.status_code == 404 and "'other' does not exist" in r.json()["error"]["message"]
    metrics = httpx.get(f"{hub_server.url}/metrics", timeout=10).text
    assert 'vllm:generation_tokens_total{model_name="tiny"}' in metrics
    assert "tiny-alias" not in metrics
    assert f"models--{REPO.replace('/', '--')}" in hub_server.log()  # the log says where it came from


def test_served_model_name_defaults_to_the_hub_id(offline_cache: Path) -> None:
    from hyserve.config import build_engine_config
    from hyserve.engine.runner.model_loader import model_source

    assert model_source(build_engine_config(model=REPO)).name == REPO
    assert (
        model_source(build_engine_config(model=REPO, load_format="dummy", revision="v2")).path.name == V2_SHA
    )


def test_serve_a_missing_hub_id_exits_naming_it(hf_home: Path) -> None:
    cmd = [sys.executable, "-m", "hyserve.cli", "serve", "nobody/nothing", "--port", "0"]
    r = subprocess.run(
        cmd, env=offline_env(hf_home), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert "'nobody/nothing' (revision main) is not in the Hub cache" in r.stderr
    assert "HF_HUB_OFFLINE is set" in r.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"served_model_name": []}, "served_model_name: expected at least one name, got an empty list"),
        ({"served_model_name": ["a", 3]}, r"served_model_name\[1\]: expected a non-empty string, got 3"),
        ({"served_model_name": " "}, "served_model_name: expected a non-empty string"),
        ({"served_model_name": "m" * 257}, "served_model_name: 257 characters; a model name has at most 256"),
        ({"served_model_name": {"a": 1}}, "served_model_name: expected a string"),
        ({"revision": ""}, "revision: expected a non-empty string"),
        ({"revision": 3}, "revision: expected a non-empty string, got 3"),
        ({"download_dir": 5}, "download_dir: expected a path, got 5"),
    ],
)
def test_bad_names_revisions_and_download_dirs_are_refused(options: dict, message: str) -> None:
    from hyserve.config import build_engine_config

    with pytest.raises(ValueError, match=message):
        build_engine_config(options)


def test_served_model_names_from_flags_and_yaml(tmp_path: Path) -> None:
    from hyserve.cli import build_parser, engine_options_from_args
    from hyserve.config import build_engine_config

    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b", "--revision", "v2"])
    opts, _, _ = engine_options_from_args(args)
    cfg = build_engine_config(opts)
    assert cfg.served_names == ("a", "b") and cfg.revision == "v2"
    yml = tmp_path / "c.yml"
    yml.write_text("served_model_name: [x, y]\ndownload-dir: /data/hub\nrevision: main\n")
    opts, _, _ = engine_options_from_args(build_parser().parse_args(["serve", "--config", str(yml)]))
    cfg = build_engine_config(opts)
    assert cfg.served_names == ("x", "y") and cfg.download_dir == "/data/hub"
    assert build_engine_config(served_model_name="one").served_names == ("one",)
