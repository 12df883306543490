"""`replayssm serve`: build the engine, start its loop, and serve the OpenAI API with uvicorn.

`build_app` wires an engine into an app (loop thread + metrics observer); `BackgroundServer`
runs that app on a thread (tests, benchmarks, notebooks); `serve_main` is the CLI entry:

    replayssm serve demo --device cpu --port 8000
    curl localhost:8000/v1/completions -H 'content-type: application/json' \
        -d '{"model": "demo-v1-seed0", "prompt": "Hello", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time

from replayssm.config_flags import add_engine_args, engine_kwargs

API_KEY_ENV = "REPLAYSSM_API_KEY"
UVICORN_GRACE_S = 5  # uvicorn's own wait for connections once the app has drained


def build_app(engine, served_model_name: str | None = None, **access):
    """(app, started EngineLoop) serving `engine` under `served_model_name` (default engine.model_name);
    `access`: the API key and CORS options of `gate.add_gate`."""
    # fastapi & co. load here, not at import: the CLI imports this module for every subcommand.
    from replayssm.server.api import create_app
    from replayssm.server.async_engine import EngineLoop
    from replayssm.server.metrics import ServingMetrics

    engine_loop = EngineLoop(engine)
    metrics = ServingMetrics(lambda: engine_loop.metrics_snapshot)
    engine_loop.observer = metrics  # set before start(): the loop thread is its only caller
    engine_loop.start()
    app = create_app(engine_loop, served_model_name or engine.model_name, metrics, **access)
    return app, engine_loop


def make_server(app, host: str, port: int, log_level: str, shutdown_timeout: float):
    """A uvicorn server for `app` that drains it on SIGINT / SIGTERM (gate.DrainingServer)."""
    import uvicorn

    from replayssm.server.gate import DrainingServer

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=UVICORN_GRACE_S)
    return DrainingServer(config, app.state.server, shutdown_timeout)


class BackgroundServer:
    """uvicorn on a daemon thread; port 0 picks a free port (read it from `.port` after start()).
    `server.handle_exit(signal.SIGTERM, None)` drains it as the signal would."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, served_model_name: str | None = None,
                 log_level: str = "warning", shutdown_timeout: float = 10.0, **access):
        self.app, self.engine_loop = build_app(engine, served_model_name, **access)
        self.server = make_server(self.app, host, port, log_level, shutdown_timeout)
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="replayssm-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("uvicorn failed to start (port in use?)")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10.0)
        self.engine_loop.shutdown()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _within(cast: type, low: float, high: float = float("inf")):
    """An argparse type: cast(text) in [low, high], so a bad value stops `serve` before the model loads."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if not low <= value <= high:
            span = f"in [{low}, {high}]" if high < float("inf") else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return parse


def _string_list(text: str) -> list[str]:
    """An argparse type: a JSON list of strings (vLLM's spelling, '["*"]') or comma-separated words."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a list of strings, got {text}")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`serve` flags: the model (positional or --model), --host/--port/--served-model-name/--log-level/
    --seed, access (--api-key, CORS) plus every engine flag."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="checkpoint directory or 'demo', the same as --model")
    add_engine_args(parser, model_required=False)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to bind, 0.0.0.0 for every interface (default: 127.0.0.1)")
    group.add_argument("--port", type=_within(int, 0, 65535), default=8000,
                       help="TCP port to listen on, 0-65535 (default: 8000)")
    group.add_argument("--served-model-name", default=None,
                       help="model name clients must send (default: the checkpoint directory's name)")
    group.add_argument("--seed", type=int, default=0,
                       help="engine seed: demo weights and the seeds of requests that give none (default: 0)")
    group.add_argument("--shutdown-timeout", type=_within(float, 0), default=10.0,
                       help="on SIGINT / SIGTERM new requests get 503 and running ones this many seconds "
                       "to finish; then streams end with finish_reason 'abort' and [DONE], other requests "
                       "with a 503 (default: 10)")
    group.add_argument("--log-level", default="info", help="uvicorn log level (default: info)",
                       choices=["critical", "error", "warning", "info", "debug"])
    access = parser.add_argument_group("access")
    access.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        f"(default: ${API_KEY_ENV}, else no key)")
    access.add_argument("--allowed-origins", type=_string_list, default=None,
                        help="CORS: origins browsers may call from, a JSON list or comma-separated, e.g. "
                        "'[\"*\"]' (default: CORS off)")
    access.add_argument("--allowed-methods", type=_string_list, default=None,
                        help="CORS: allowed methods (default: all; needs --allowed-origins)")
    access.add_argument("--allowed-headers", type=_string_list, default=None,
                        help="CORS: allowed request headers (default: all; needs --allowed-origins)")
    access.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow cookies and credentials (needs --allowed-origins)")


def resolve_model(args: argparse.Namespace) -> str:
    """The model to serve, given positionally or as --model (both is fine only when they agree)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two different models: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag if args.model_tag is not None else args.model
    if not model:
        raise ValueError("no model: replayssm serve MODEL (a checkpoint directory or 'demo')")
    return model


def access_options(args: argparse.Namespace) -> dict:
    """`add_gate`'s keyword arguments from the flags; the key comes from the environment when the flag
    is absent (an empty variable means no key)."""
    if args.api_key == "":
        raise ValueError("--api-key must not be empty")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    cors = {"allowed_methods": args.allowed_methods, "allowed_headers": args.allowed_headers,
            "allow_credentials": args.allow_credentials}
    if not args.allowed_origins and any(cors.values()):
        flags = ", ".join("--" + k.replace("_", "-") for k, v in cors.items() if v)
        raise ValueError(f"{flags} needs --allowed-origins (CORS is off without it)")
    return {"api_key": api_key, "allowed_origins": args.allowed_origins, **cors}


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object; its handler is `serve_main`."""
    help_text = "serve a checkpoint over an OpenAI-compatible HTTP API"
    parser = subparsers.add_parser("serve", help=help_text, description=help_text)
    add_serve_args(parser)
    parser.set_defaults(func=serve_main)
    return parser


def build_engine(args: argparse.Namespace):
    """The LLMEngine described by parsed `serve` flags."""
    from replayssm.config import EngineConfig
    from replayssm.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(args.model, seed=args.seed, **engine_kwargs(args)))


def freeze_heap() -> int:
    """Collect once, then move every object alive now (torch, the model, the engine) out of the
    garbage collector's scans for the rest of the process; return how many were moved.

    A full collection walks every tracked object while holding the GIL, so the engine loop and every
    request wait through it: with torch, transformers and an engine of the 8B's 52-layer pattern at
    a tiny width loaded (~250k tracked objects), the one full collection of a 300-step decode run at
    batch 256 takes 117 ms on a 2-core CPU; with them frozen none runs. Only for an engine that lives
    as long as the process: frozen objects leave the collector for good, so reference cycles of an
    engine dropped later (and the device memory they hold) would never be freed.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve_main(args: argparse.Namespace) -> int:
    """Build the engine from parsed flags, start its loop, and serve until interrupted."""
    try:
        import uvicorn  # noqa: F401
    except ImportError as exc:  # the CLI turns ValueError into a one-line message
        raise ValueError("serve needs the server extra: pip install -e '.[server]'") from exc

    args.model = resolve_model(args)
    access = access_options(args)
    engine = build_engine(args)
    app, engine_loop = build_app(engine, args.served_model_name, **access)
    freeze_heap()  # the engine serves until the process exits
    try:
        make_server(app, args.host, args.port, args.log_level, args.shutdown_timeout).run()
    finally:
        engine_loop.shutdown()
    return 0
