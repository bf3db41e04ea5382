"""The routes around generation: `GET /v1/models` (and one model), `GET|HEAD /health`, `GET /metrics`
(Prometheus) and `GET /version`. Health, metrics and version stay open without the API key, for probes."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from hyserve.server.errors import error_body
from hyserve.server.metrics import CONTENT_TYPE
from hyserve.server.protocol import ErrorResponse, ModelCard, ModelList, VersionResponse
from hyserve.server.state import ERROR_RESPONSES, AppState, hyserve_version


def model_card(state: AppState) -> ModelCard:
    engine = state.engine
    root = getattr(getattr(engine, "config", None), "model", None)
    return ModelCard(id=engine.model_name, root=root, max_model_len=engine.max_seq_len)


def health_response(state: AppState) -> JSONResponse:
    """200 when the server accepts requests and the engine runs; 503 naming why otherwise."""
    if not state.accepting:
        return JSONResponse(
            error_body(
                "the server is shutting down (draining the requests in flight)",
                err_type="service_unavailable_error",
                code="shutting_down",
            ),
            status_code=503,
        )
    if state.engine.healthy:
        return JSONResponse({"status": "ok"})
    reason = getattr(state.engine, "dead_reason", None) or "unknown"
    return JSONResponse(
        error_body(
            f"the engine is not running: {reason}",
            err_type="service_unavailable_error",
            code="engine_unavailable",
        ),
        status_code=503,
    )


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(state)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def get_model(model_id: str) -> ModelCard:
        state.check_model(model_id or "\0")
        return model_card(state)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    @app.head("/health", include_in_schema=False)  # load-balancer probes that send HEAD
    async def health() -> JSONResponse:
        return health_response(state)

    @app.get("/metrics", response_class=Response)
    async def metrics_route() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=hyserve_version())
