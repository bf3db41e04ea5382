"""OpenAI-compatible HTTP server over the async engine (FastAPI + uvicorn).

`build_app(engine, ServerOptions(...))` makes the app; `run_server(...)` (in `serve.py`) loads the
engine and serves it. Imports here stay light: FastAPI is only imported when the app is built.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerOptions", "build_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name in ("ServerOptions", "build_app"):
        from hyserve.server import app

        return getattr(app, name)
    if name == "run_server":
        from hyserve.server.serve import run_server

        return run_server
    raise AttributeError(name)
