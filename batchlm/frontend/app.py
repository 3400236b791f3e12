"""The FastAPI app: OpenAI's routes, translated to the shared request schema and sent to Triton.

    app = create_app("127.0.0.1:8001")     # serve with uvicorn; see __main__.py

Routes: `GET /v1/models`, `GET /v1/models/{model}`, `POST /v1/completions`, `POST /v1/chat/completions`
(answered by generate.py), `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (tokenize.py),
`GET /health` (200 while Triton is ready, else 503) and `GET /metrics` (metrics.py, Prometheus' text
format). Every error is OpenAI's error JSON (errors.py). With an API key, every route but `/health` and
`/metrics` answers 401 to a request without it (auth.py). What the frontend reads of each model (config,
tokenizer, chat template) is served_models.py's.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from batchlm.errors import InvalidArgument
from batchlm.frontend import errors, tokenize
from batchlm.frontend.auth import RequireApiKey
from batchlm.frontend.errors import ApiError
from batchlm.frontend.generate import ClientGone, generate
from batchlm.frontend.metrics import FrontendMetrics
from batchlm.frontend.protocol import ChatCompletionRequest, CompletionRequest, template_messages
from batchlm.frontend.schema_request import DEFAULT_CHAT_MAX_TOKENS, chat_request, completion_request
from batchlm.frontend.served_models import ServedModels
from batchlm.frontend.triton_client import SERVABLE_MODELS, TritonBackend
from batchlm.frontend.validation import validation_error


def create_app(triton_grpc: str, models: tuple[str, ...] = SERVABLE_MODELS, timeout: float | None = None,
               api_key: str | None = None) -> FastAPI:
    """The frontend for the Triton server whose gRPC endpoint is `triton_grpc` ("host:port"), serving
    `models` where Triton has them ready; `timeout`: seconds per Triton request (None: no limit);
    `api_key`: the bearer token every route but `/health` and `/metrics` asks for (None: none asked)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # NOTE: the aio channel belongs to the event loop it was made on: make it on uvicorn's
        app.state.backend = TritonBackend(triton_grpc, models, timeout)
        app.state.models = ServedModels(app.state.backend)
        app.state.metrics = FrontendMetrics()
        yield
        await app.state.backend.close()

    app = FastAPI(title="batchlm OpenAI-compatible frontend", lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(RequireApiKey, key=api_key)
    app.include_router(tokenize.router)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _gone(_request: Request, _exc: ClientGone) -> Response:
        return Response(status_code=499)  # NOTE: nobody reads it; nginx's code for "client closed"

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ready = await request.app.state.backend.server_ready()
        return JSONResponse({"triton_ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        served = await request.app.state.backend.served()
        return {"object": "list", "data": [_model_card(m) for m in served]}

    @app.get("/v1/models/{model}")
    async def get_model(request: Request, model: str) -> dict:
        backend: TritonBackend = request.app.state.backend
        served = await backend.served()
        if model not in served:
            raise errors.model_not_found(model, served)
        return _model_card(model)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        served: ServedModels = request.app.state.models
        info = await served.info(body.model)
        return await generate(request, served, info, completion_request(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        served: ServedModels = request.app.state.models
        info = await served.info(body.model)
        try:
            prompt = served.template(info).render(template_messages(body.messages))
        except InvalidArgument as exc:
            raise errors.invalid(exc.field, exc.message) from None
        schema = chat_request(body, prompt, await served.rest_of_context(info, prompt, DEFAULT_CHAT_MAX_TOKENS))
        return await generate(request, served, info, schema, chat=True)

    return app


def _model_card(model: str) -> dict:
    return {"id": model, "object": "model", "created": 0, "owned_by": "batchlm"}
