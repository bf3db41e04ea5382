"""The routes around generation: `GET /v1/models` (and one model), `GET|HEAD /health` (and `/ping`, its
name on SageMaker and in vLLM), `GET /metrics` (Prometheus) and `GET /version`. Health, ping, metrics and
version stay open without the API key, for probes.

The OpenAI routes of other kinds of model (`/v1/embeddings`, `/v1/audio/...`, `/v1/images/...`) answer a
404 that says what this server serves instead, so a client pointed at the wrong server learns why."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from hyserve.server.errors import APIError, error_body
from hyserve.server.metrics import CONTENT_TYPE
from hyserve.server.protocol import ErrorResponse, ModelCard, ModelList, VersionResponse
from hyserve.server.state import ERROR_RESPONSES, AppState, hyserve_version


def model_card(state: AppState, name: str | None = None) -> ModelCard:
    """The card of one served name (default: the reported one, the first)."""
    engine = state.engine
    root = getattr(getattr(engine, "config", None), "model", None)
    return ModelCard(id=name or engine.model_name, root=root, max_model_len=engine.max_seq_len)


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


# route prefix -> what its clients wanted (the OpenAI API's own names)
NOT_SERVED = {
    "/v1/embeddings": "embeddings",
    "/v1/audio": "audio (speech, transcriptions, translations)",
    "/v1/images": "images (generations, edits, variations)",
}
SERVED_ROUTES = "POST /v1/chat/completions, /v1/completions and /v1/responses, GET /v1/models"


def not_served(state: AppState, prefix: str) -> APIError:
    return APIError(
        f"this server does not serve {NOT_SERVED[prefix]} ({prefix}): it generates text with "
        f"{state.engine.model_name!r}, a hybrid Mamba2 + attention language model, through {SERVED_ROUTES}",
        status_code=404,
        code="unsupported_endpoint",
    )


def _add_not_served_routes(app: FastAPI, state: AppState) -> None:
    methods = ["GET", "POST", "PUT", "DELETE"]

    def refusal(prefix: str) -> Callable[[], Awaitable[Response]]:
        async def refuse() -> Response:
            raise not_served(state, prefix)

        return refuse

    for prefix in NOT_SERVED:
        refuse = refusal(prefix)
        app.add_api_route(prefix, refuse, methods=methods, include_in_schema=False)
        app.add_api_route(prefix + "/{rest:path}", refuse, methods=methods, include_in_schema=False)


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(state, name) for name in state.listed_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def get_model(model_id: str) -> ModelCard:
        state.check_model(model_id or "\0")
        return model_card(state, model_id if model_id in state.listed_names else None)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    @app.head("/health", include_in_schema=False)  # load-balancer probes that send HEAD
    @app.get("/ping", include_in_schema=False)  # SageMaker's and vLLM's name for it
    @app.post("/ping", include_in_schema=False)
    @app.head("/ping", include_in_schema=False)
    async def health() -> JSONResponse:
        return health_response(state)

    _add_not_served_routes(app, state)

    @app.get("/metrics", response_class=Response)
    async def metrics_route() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=hyserve_version())
