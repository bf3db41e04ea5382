"""Every server setting is checked at start-up (docs/architecture.md, "Server settings"): a bad one makes
`hyserve serve` exit with status 2 and one line naming the key, before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyserve.cli import main
from hyserve.server.state import ServerOptions

_BAD_YAML = [
    ("api_key: 12345\n", "api_key: expected a string, got 12345"),
    ('api_key: ""\n', "api_key: the key is empty"),
    ("served_model_name: 123\n", "served_model_name: expected a string, got 123"),
    ("log_level: loud\n", "log_level: 'loud' is not one of"),
    ("port: 70000\n", "port: must be <= 65535, got 70000"),
    ("port: '8000'\n", "port: expected an integer"),
    ("host: 5\n", "host: expected a string, got 5"),
    ("seed: 18446744073709551616\n", "seed: must be <= 9223372036854775807"),
    ("reasoning_parser: 7\n", "reasoning_parser: expected a string"),
    ("tool_parser: nope\n", "tool_parser: 'nope' is not one of"),
    ("default_max_tokens: 0\n", "default_max_tokens: must be >= 1"),
    ("max_request_body_bytes: 10\n", "max_request_body_bytes: must be >= 1024"),
    ("max_request_body_bytes: 1.5e9\n", "max_request_body_bytes: expected an integer"),
    ("shutdown_timeout: -1\n", "shutdown_timeout: expected a number of seconds >= 0"),
    ("no_auth: 1\n", "no_auth: expected true or false"),
]


@pytest.mark.parametrize(("yaml_text", "message"), _BAD_YAML, ids=[y.split(":")[0] for y, _ in _BAD_YAML])
def test_bad_yaml_setting_fails_at_startup(
    yaml_text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "serve.yml"
    cfg.write_text(yaml_text)
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "starting" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--api_key", ""], "api_key: the key is empty"),
        (["--api_key", " k3y"], "api_key: must not start or end with whitespace"),
        (["--port", "-1"], "port: must be >= 0, got -1"),
        (["--port", "65536"], "port: must be <= 65535"),
        (["--log_level", "LOUD"], "log_level: 'LOUD' is not one of"),
        (["--seed", str(2**64)], "seed: must be <= 9223372036854775807"),
        (["--seed", str(-(2**63) - 1)], "seed: must be >= -9223372036854775808"),
        (["--host", ""], "host: must not be empty"),
        (["--shutdown_timeout", "inf"], "shutdown_timeout: expected a number of seconds"),
        (["--no_auth", "--api_key", "k3y"], "--no_auth and a non-empty api_key"),
        (["--reasoning_parser", "nope"], "reasoning_parser: 'nope' is not one of"),
    ],
)
def test_bad_flag_fails_at_startup(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_explicit_no_auth_and_null_key_are_accepted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--no_auth` turns an empty key into no authentication; `api_key: null` in YAML is no authentication."""
    seen: list[ServerOptions] = []

    def fake_run(config: object, opts: ServerOptions, **_: object) -> int:
        seen.append(opts)
        return 0

    monkeypatch.setattr("hyserve.server.serve.run_server", fake_run)
    assert main(["serve", "--no_auth", "--api_key", ""]) == 0
    cfg = tmp_path / "serve.yml"
    cfg.write_text(
        "api_key: null\nport: 0\nlog_level: WARNING\nmax_request_body_bytes: 4096\nshutdown_timeout: 2\n"
    )
    assert main(["serve", "--config", str(cfg)]) == 0
    assert main(["serve", "--api_key", "k3y", "--port", "9001", "--shutdown_timeout", "0"]) == 0
    assert [o.api_key for o in seen] == [None, None, "k3y"]
    assert (seen[1].port, seen[1].log_level, seen[1].max_request_body_bytes, seen[1].shutdown_timeout) == (
        0,
        "warning",
        4096,
        2.0,
    )
    assert (seen[2].port, seen[2].shutdown_timeout) == (9001, 0.0)


def test_server_options_checks_types_directly() -> None:
    with pytest.raises(ValueError, match="api_key: expected a string, got 12345"):
        ServerOptions(api_key=12345)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port: expected an integer, got True"):
        ServerOptions(port=True)
    assert ServerOptions(log_level="DEBUG").log_level == "debug"
