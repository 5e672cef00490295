"""The FastAPI app: routes, error handlers, gate and body limit, engine lifecycle."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm import __version__
from pagedllm.engine.block_size_choice import RequestLengthLog
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.server.async_engine import AsyncEngine
from pagedllm.server.chat import create_chat_completion
from pagedllm.server.completions import create_completion
from pagedllm.server.dashboard.routes import install_dashboard
from pagedllm.server.errors import install_error_handlers
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.middleware import BodyLimit, Gate
from pagedllm.server.reply_size import DEFAULT_MAX_LOGPROB_ENTRIES
from pagedllm.server.response_store import DEFAULT_CAPACITY, ResponseStore
from pagedllm.server.responses import TokenTexts
from pagedllm.server.responses_api import ResponsesAPI
from pagedllm.server.serving import ServingContext, model_not_found
from pagedllm.server.tokenize import detokenize, tokenize, tokenizer_info

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(model: str | None) -> str:
    """The name clients use: the model path's last component, without ``.gguf``."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass
class ServerSettings:
    """HTTP-side limits. ``max_body_bytes``: largest request body accepted;
    ``max_pending_requests``: engine requests admitted and unfinished before 503;
    ``read_timeout_s``: seconds a request body may take to arrive whole (408 after);
    ``max_logprob_entries``: the most logprob entries one request may ask for (400
    beyond; :mod:`pagedllm.server.reply_size`);
    ``api_key_scope``: ``"v1"`` (the key guards ``/v1/`` only) or ``"all"`` (every
    path but ``/health`` and the dashboard's page); ``max_stored_responses``:
    responses kept for the Responses API's ``previous_response_id`` (the least recently
    used dropped first)."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_pending_requests: int = 1024
    api_key_scope: str = "v1"
    max_stored_responses: int = DEFAULT_CAPACITY
    read_timeout_s: float = 30.0
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    kv_cache_metrics_sample: float | None = None
    """Sample rate of the block-lifetime histograms; None: not collected."""


@dataclass
class Lifecycle:
    """``draining`` turns true when shutdown begins: new requests then get 503.
    ``engine_failed`` turns true if the engine loop dies; ``request_exit`` (set by
    whoever runs the server) is then called, so the process can exit non-zero."""

    draining: bool = False
    engine_failed: bool = False
    request_exit: Callable[[], None] | None = None

    def engine_loop_died(self) -> None:
        self.engine_failed = True
        if self.request_exit is not None:
            self.request_exit()


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """An app serving ``engine``; its engine loop runs from startup to shutdown.

    ``/health`` answers 200 while the engine loop runs, 503 when it has died or the
    server is shutting down.
    """
    metrics = ServerMetrics(settings.model_name)
    lifecycle = Lifecycle()
    async_engine = AsyncEngine(
        engine,
        metrics,
        settings.max_pending_requests,
        lifecycle.engine_loop_died,
        settings.max_logprob_entries,
        RequestLengthLog(str(engine.loaded.source)),
    )
    ctx = ServingContext(
        async_engine,
        settings.model_name,
        TokenTexts(engine.tokenizer),
        engine.tokenizer,
        engine.model_config.vocab_size,
        engine.max_model_len,
    )
    started = int(time.time())
    if settings.kv_cache_metrics_sample is not None:
        metrics.follow_block_lifetimes(engine.block_manager.pool, settings.kv_cache_metrics_sample)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        lifecycle.draining = True
        await async_engine.stop()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    app.state.async_engine = async_engine
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(raw, ctx)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(raw, ctx)

    responses_api = ResponsesAPI(ctx, ResponseStore(settings.max_stored_responses))

    @app.post("/v1/responses")
    async def create_response(raw: Request) -> Response:
        return await responses_api.create(raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False) -> Response:
        return responses_api.retrieve(response_id, stream)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses_api.delete(response_id)

    card = {
        "id": settings.model_name,
        "object": "model",
        "created": started,
        "owned_by": "pagedllm",
        "max_model_len": engine.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != settings.model_name:
            raise model_not_found(ctx, model_id)
        return JSONResponse(card)

    @app.post("/tokenize")
    async def tokenize_route(raw: Request) -> Response:
        return await tokenize(raw, ctx)

    @app.post("/detokenize")
    async def detokenize_route(raw: Request) -> Response:
        return await detokenize(raw, ctx)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        return await tokenizer_info(ctx)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            raise async_engine.unavailable()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    install_dashboard(app, async_engine, settings.model_name, lambda: lifecycle.draining)

    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.read_timeout_s
    )
    app.add_middleware(
        Gate,
        api_key=settings.api_key,
        is_draining=lambda: lifecycle.draining,
        api_key_scope=settings.api_key_scope,
    )
    return app
