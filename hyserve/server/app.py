"""The FastAPI app: OpenAI-compatible routes over an `AsyncEngine`.

    POST /v1/chat/completions   POST /v1/completions       POST /v1/responses   (SSE or one JSON body)
    GET  /v1/models             GET  /v1/models/{model}
    POST /tokenize              POST /detokenize
    GET  /health (and HEAD)     GET  /metrics              GET /version

One module per route family (`serving_chat.py`, `serving_completion.py`, `serving_responses.py`,
`serving_tokenize.py`, `serving_admin.py`), each a function of (request, `AppState`); `state.py` holds what
they share and `generation.py` runs their engine requests. A request goes: validate (pydantic, then our own
checks, then `engine.validate_request`, so every 4xx is decided before anything runs) -> `engine.generate` ->
deltas -> reasoning / tool-call parsing -> response. Three failure rules shape the code:

- a request the engine can never serve is a 400 that names the limit (never a crash, never a hang);
- a client that goes away has its engine request aborted at once, so its KV blocks and state slot
  return to the pool (`generation.py`);
- a failure after the 200 of a stream is reported in-band: `data: {"error": ...}` then `data: [DONE]`.

`build_app(engine, options)` takes anything with the `AsyncEngine` interface, so the app can be tested
in-process with a fake engine as well as end to end.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI

from hyserve.server import (
    serving_admin,
    serving_chat,
    serving_completion,
    serving_responses,
    serving_tokenize,
)
from hyserve.server.body import BodyRoute
from hyserve.server.errors import install_error_handlers
from hyserve.server.metrics import ServerMetrics
from hyserve.server.middleware import ApiMiddleware
from hyserve.server.state import AppState, ServerOptions, hyserve_version

logger = logging.getLogger("hyserve.server")

__all__ = ["ServerOptions", "build_app", "hyserve_version"]


def build_app(engine: Any, server_options: ServerOptions | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine` (an `AsyncEngine`, already started)."""
    opts = server_options or ServerOptions()
    metrics = ServerMetrics(engine.stats, engine.model_name)
    app = FastAPI(
        title="hyserve",
        version=hyserve_version(),
        description="OpenAI-compatible server for hybrid Mamba2 + attention models (NemotronH).",
    )
    app.state.engine = engine
    app.state.options = opts
    app.state.metrics = metrics
    app.router.route_class = BodyRoute  # JSON bodies parsed with a bounded cost on the event loop (body.py)
    install_error_handlers(app)
    app.add_middleware(
        ApiMiddleware,
        api_key=opts.api_key,
        metrics=metrics,
        max_body_bytes=opts.max_request_body_bytes,
        read_timeout=opts.request_read_timeout,
        max_inflight_body_bytes=opts.max_inflight_body_bytes,
    )
    if opts.allowed_origins:  # outermost, so that its headers are on every answer (401s, 413s too)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(opts.allowed_origins),
            allow_methods=list(opts.allowed_methods),
            allow_headers=list(opts.allowed_headers),
            allow_credentials=opts.allow_credentials,
        )
    state = AppState(engine, opts, metrics, app.state)
    if opts.tool_parser is None:
        logger.info("no --tool_parser: requests with `tools` get the model's raw output as content")
    serving_chat.add_routes(app, state)
    serving_completion.add_routes(app, state)
    serving_responses.add_routes(app, state)
    serving_tokenize.add_routes(app, state)
    serving_admin.add_routes(app, state)
    return app
