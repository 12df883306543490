"""FastAPI routes: OpenAI completions and chat (streaming and not), models, tokenize and
detokenize, health, version, metrics.

Every user error becomes a 4xx with an OpenAI error body; the engine keeps running. A client
that disconnects aborts its requests: streaming responses abort when their generator is
cancelled (and again, idempotently, in the response's background task, which also covers a
generator that never started); non-streaming handlers race the result against http.disconnect.
On shutdown `ServerState.drain` stops admitting, lets open requests finish for a while, then ends
each one cleanly: a stream with a final finish_reason "abort" event and `data: [DONE]`, any other
request with a 503.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import replayssm
from replayssm.sampling_params import check_structured
from replayssm.server.async_engine import AsyncEngine, EngineDeadError, EngineLoop, RequestGroup
from replayssm.server.gate import Admission, add_gate
from replayssm.server.handlers import ChatHandler, CompletionHandler, detokenize, tokenize
from replayssm.server.metrics import ServingMetrics
from replayssm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    VersionResponse,
    check_text,
    now_s,
)
from replayssm.server.serving import sse

# Text longer than this many characters per token of the context cannot be a prompt that fits: refused
# before tokenizing, which takes seconds and holds gigabytes of tokenizer memory for megabytes of text.
MAX_CHARS_PER_TOKEN = 16
MAX_BODY_BYTES = 64 << 20  # a request body past this gets a 413 before it is read whole
STOP_GRACE_S = 5.0  # after the drain timeout: how long stopped responses get to send their last events


class ServerState:
    """What the routes share: the engine front, its tokenizer and limits, and the metrics."""

    def __init__(self, engine_loop: EngineLoop, served_model_name: str, metrics: ServingMetrics):
        engine = engine_loop.engine
        self.engine = AsyncEngine(engine_loop)
        self.tokenizer = engine.tokenizer
        self.structured = getattr(engine, "structured", None)  # the grammar compiler (engine/structured.py)
        self.max_model_len = int(engine.max_model_len)
        # generation_config.json sampling defaults for fields a request leaves unset (LLMEngine).
        self.generation_defaults = dict(getattr(engine, "generation_defaults", {}))
        self.model_name = served_model_name
        self.metrics = metrics
        self.created = now_s()
        self.max_prompt_chars = MAX_CHARS_PER_TOKEN * self.max_model_len
        self.admission = Admission()
        self.open_groups: set[RequestGroup] = set()
        self.stopping = False

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def compile_structured(self, spec: dict | None, param: str) -> dict | None:
        """Compile a request's grammar in the handler's worker thread (the engine thread then finds it
        cached); returns spec. A schema or regex the compiler refuses is a 400 naming `param`."""
        if spec is not None and self.structured is not None:
            try:
                self.structured.compile(check_structured(spec))
            except ValueError as exc:
                raise APIError(400, str(exc), param=param) from exc
        return spec

    def encode(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (the engine range-checks token-id prompts itself)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise APIError(400, f"{self.model_name} has no tokenizer: send prompts as token ids", param=param)
        self.check_size(len(prompt), param)
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def check_size(self, num_chars: int, param: str) -> None:
        """Refuse text too long to fit the context whatever its tokens, before anything tokenizes it."""
        if num_chars > self.max_prompt_chars:
            raise APIError(400, f"{param} has {num_chars} characters; a {self.max_model_len}-token context "
                           f"takes at most {self.max_prompt_chars} ({MAX_CHARS_PER_TOKEN} per token)",
                           param=param, code="context_length_exceeded")

    def track(self, group: RequestGroup) -> None:
        """Count a group as open until `release`; one added after the drain deadline stops at once."""
        self.open_groups.add(group)
        if self.stopping:
            self._stop(group)

    def release(self, group: RequestGroup) -> None:
        """The group's response is over: abort what is unfinished (idempotent)."""
        self.open_groups.discard(group)
        if not group.done:
            self.engine.abort(group)

    def stop_open(self) -> None:
        """End every open group now: abort it in the engine, and let its response finish with what it has."""
        self.stopping = True
        for group in list(self.open_groups):
            self._stop(group)

    def _stop(self, group: RequestGroup) -> None:
        self.engine.abort(group)
        group.stop()

    async def drain(self, timeout: float) -> None:
        """Shutdown: admit nothing new (503), give open requests `timeout` seconds to finish, then stop
        them and wait (briefly) for their final events to go out."""
        self.admission.draining = True
        if not await self.admission.wait_idle(timeout):
            self.stop_open()
            await self.admission.wait_idle(STOP_GRACE_S)


def error_response(err: APIError, metrics: ServingMetrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.http_errors.labels(status=str(err.status_code)).inc()
    return JSONResponse(ErrorResponse.from_api_error(err).model_dump(), status_code=err.status_code)


async def read_body(request: Request) -> bytes:
    """The request body, refused with a 413 as soon as it is known to pass MAX_BODY_BYTES."""
    too_large = APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    return bytes(body)


async def parse_json(request: Request) -> object:
    """The parsed JSON body, every string in it valid Unicode; malformed bodies are 400s."""
    body = await read_body(request)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc
    check_text(body, data)
    return data


async def parse_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """Strict JSON -> schema; malformed JSON and wrong types are 400s naming the first bad field."""
    return validate(schema, await parse_json(request))


def validate(schema: type[BaseModel], data: object) -> BaseModel:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        errors = [(_field_path(e["loc"]), e["msg"].removeprefix("Value error, ")) for e in exc.errors()]
        loc = errors[0][0]
        # A field of several accepted forms (prompt: text, token ids, lists of either) fails once per
        # form: name them all, not only the first.
        said = " or ".join(dict.fromkeys(msg for where, msg in errors if where == loc))
        raise APIError(400, f"{loc or 'body'}: {said}", param=loc or None) from exc


def _field_path(loc: tuple) -> str:
    """"messages.0.content" from a pydantic error location, without the union branches' type tags
    ("str", "list[int]", "function-after[...]") it puts among the field names."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_to_completion(state: ServerState, group: RequestGroup, request: Request) -> bool:
    """Consume a group to the end; False (after aborting it) if the client went away first."""

    async def consume() -> None:
        async for _ in group.updates():
            pass

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
            state.engine.abort(group)
    if consumer.done() and not consumer.cancelled():
        consumer.result()  # re-raise EngineDeadError
        return True
    return False


def streaming_response(state: ServerState, group: RequestGroup,
                       chunks: Callable[[RequestGroup], AsyncIterator[str]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks(group):
                yield chunk
        except EngineDeadError as exc:
            yield sse(ErrorResponse.from_api_error(APIError(503, str(exc), type="server_error")))
        finally:
            state.release(group)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             background=BackgroundTask(state.release, group))


def create_app(engine_loop: EngineLoop, served_model_name: str, metrics: ServingMetrics,
               **access) -> FastAPI:
    """The OpenAI-compatible app over an already-started EngineLoop; `access` holds `add_gate`'s
    options (api_key, allowed_origins, allowed_methods, allowed_headers, allow_credentials)."""
    app = FastAPI(title="replayssm", docs_url=None, redoc_url=None)
    state = ServerState(engine_loop, served_model_name, metrics)
    app.state.server = state
    add_gate(app, state.admission, lambda err: error_response(err, metrics), **access)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)), metrics)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {exc!r}", type="server_error"), metrics)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, str(exc), type="server_error"), metrics)

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            return error_response(APIError(503, "engine loop is not running", type="server_error"), metrics)
        if state.admission.draining:
            return error_response(APIError(503, "the server is shutting down", type="server_error"), metrics)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=replayssm.__version__)

    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        state.check_model(model)
        return card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def serve(request: Request, handler_cls, req) -> Response:
        # Building the handler tokenizes the prompt (a chat template too): seconds for a huge prompt, so
        # off the event loop.
        handler = await asyncio.to_thread(handler_cls, state, req)
        try:
            group = await state.engine.add(handler.engine_requests.requests)
        except ValueError as exc:  # the engine's own checks (prompt length, params) are user errors
            param = getattr(exc, "param", None)  # InputError: "prompt" or "stop"
            raise APIError(400, str(exc), param=handler.prompt_param if param == "prompt" else param) from exc
        state.track(group)
        if handler.stream:
            return streaming_response(state, group, handler.chunks)
        try:
            listening = await run_to_completion(state, group, request)
        finally:
            state.release(group)
        if not listening:
            return Response(status_code=499)  # nobody is listening; the status is for logs only
        if not group.done:
            raise APIError(503, "the server is shutting down; the request was stopped", type="server_error")
        return JSONResponse(handler.response(group.latest).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        state.check_model(req.model)
        return await serve(request, CompletionHandler, req)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        state.check_model(req.model)
        return await serve(request, ChatHandler, req)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        data = await parse_json(request)
        chat = isinstance(data, dict) and "messages" in data
        req = validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
        state.check_model(req.model)
        return JSONResponse((await asyncio.to_thread(tokenize, state, req)).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest)
        state.check_model(req.model)
        return JSONResponse(detokenize(state, req).model_dump())

    return app
