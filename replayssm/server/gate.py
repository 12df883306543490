"""Who gets in: the API key, CORS, and admission while the server drains for shutdown.

    request --> CORSMiddleware (only with --allowed-origins; answers preflights itself)
            --> Gate: open path (/health, /metrics, /version, preflight OPTIONS)? --> routes
                      key set and no "Authorization: Bearer <key>"?           --> 401
                      draining?                                               --> 503
                      else count it in flight                                 --> routes

The gate is a plain ASGI middleware (not Starlette's BaseHTTPMiddleware), so streaming bodies and
client disconnects pass through it untouched.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from replayssm.server.protocol import APIError

GUARDED_PATHS = ("/tokenize", "/detokenize")  # besides everything under /v1


def is_guarded(path: str) -> bool:
    """Whether a path needs the API key: every route that reads or generates text."""
    return path == "/v1" or path.startswith("/v1/") or path in GUARDED_PATHS


class Admission:
    """The guarded requests in flight, and whether new ones are still admitted.

    Once `draining` is set, new guarded requests get a 503; `wait_idle` lets a shutdown wait for the
    ones already admitted (a streaming response counts until its last byte is sent)."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight, False if `timeout` seconds pass first."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            return False
        return True


class Gate:
    """ASGI middleware: the API key check and shutdown admission in front of the guarded routes."""

    def __init__(self, app: ASGIApp, admission: Admission, api_key: str | None,
                 reply: Callable[[APIError], Response]):
        self.app = app
        self.admission = admission
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.reply = reply

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return secrets.compare_digest(given, self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A preflight carries no credentials by design (the CORS middleware answers it when enabled).
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not is_guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self.expected is not None and not self._authorized(scope):
            response = self.reply(APIError(401, "missing or incorrect API key: send the header "
                                           "'Authorization: Bearer <key>'", code="invalid_api_key"))
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        if self.admission.draining:
            await self.reply(APIError(503, "the server is shutting down", type="server_error"))(
                scope, receive, send)
            return
        self.admission.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()


def add_gate(app: FastAPI, admission: Admission, reply: Callable[[APIError], Response], *,
             api_key: str | None = None, allowed_origins: list[str] | None = None,
             allowed_methods: list[str] | None = None, allowed_headers: list[str] | None = None,
             allow_credentials: bool = False) -> None:
    """Install the gate, and CORS around it when `allowed_origins` is given (so that 401s and 503s
    carry CORS headers too and a browser can read them)."""
    app.add_middleware(Gate, admission=admission, api_key=api_key, reply=reply)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins,
                           allow_methods=allowed_methods or ["*"], allow_headers=allowed_headers or ["*"],
                           allow_credentials=allow_credentials)


class DrainingServer(uvicorn.Server):
    """uvicorn whose SIGINT / SIGTERM drains the app before its own shutdown closes the sockets:
    `state.drain(shutdown_timeout)` refuses new work with 503 while open requests finish, and ends
    those still open at the timeout with a final event; a second signal ends them at once."""

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float):
        super().__init__(config)
        self.state = state  # api.ServerState
        self.shutdown_timeout = shutdown_timeout
        self.drain_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (main thread, maybe inside the event loop's own code: hand off to it).
        First signal: drain. Second: end open requests now and exit once their last events are out.
        Any later one is uvicorn's (a second SIGINT while exiting forces the exit)."""
        if self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
        elif not self.drain_requested:
            self.drain_requested = True
            self._loop.call_soon_threadsafe(self._begin_drain)
        else:
            self._loop.call_soon_threadsafe(self.state.stop_open)
            self.should_exit = True

    def _begin_drain(self) -> None:
        self._drain = asyncio.ensure_future(self.state.drain(self.shutdown_timeout))
        self._drain.add_done_callback(lambda _: setattr(self, "should_exit", True))
