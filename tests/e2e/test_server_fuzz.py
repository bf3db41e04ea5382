"""Schemathesis fuzz of the server's own OpenAPI schema against a real `hyserve serve` (tiny model, CPU):
whatever the generated request, the answer is never a 5xx and the server keeps running.

Bounded (~15 examples per operation, ~130 requests) with a short max_seq_len and default max_tokens
so generation stays cheap on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

schemathesis = pytest.importorskip(
    "schemathesis", reason="the fuzz test needs schemathesis (pip install schemathesis)"
)
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from hyserve.server.app import build_app  # noqa: E402
from tests.server_fixtures import FakeEngine, ServerProcess  # noqa: E402

EXAMPLES_PER_OPERATION = 15


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    s = ServerProcess(
        args=[
            "--max_seq_len",
            "256",
            "--default-max-tokens",
            "16",
            "--max_batch_size",
            "8",
            "--disable-log-requests",
            "--reasoning_parser",
            "nemotron-v3",
            "--tool_parser",
            "qwen3_coder",
        ]
    ).start()
    yield s
    assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200, s.log()
    assert s.stop() == 0, s.log()


# The schema is static (routes + pydantic models), so it is taken from an app over a fake engine at import
# time; the requests go to the real server. (schemathesis' lazy `from_fixture` loader does not work with
# this pytest version.)
schema = schemathesis.openapi.from_dict(build_app(FakeEngine()).openapi())


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case, fuzz_server: ServerProcess) -> None:
    response = case.call(base_url=fuzz_server.url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
