"""One background thread drives LLMEngine.step(); asyncio handlers talk to it by request id.

The engine is not thread-safe, so only the loop thread ever touches it. Everyone else sends
commands (add, abort, call) through a queue and gets a `concurrent.futures.Future` back; the
loop thread applies commands between steps, so an abort always lands on a step boundary.

    handler (event loop)            loop thread                    engine
    --------------------            -----------                    ------
    add_group(...) ---- command --> engine.add_request(...) ------> waiting
        await future <-- result --/
    async for update in group  <-- call_soon_threadsafe(sink) <--- step() outputs
    disconnect: abort(ids) ------> engine.abort_request(id) ------> freed at next step

Outputs are cumulative (all tokens so far), so a slow consumer only ever needs the latest one:
`RequestGroup` keeps the newest output per sub-request and wakes its consumer with one Event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

Sink = Callable[[Any], None]  # receives a RequestOutput, or the exception that ended the loop


class LoopObserver(Protocol):
    """Hooks the loop thread calls (metrics); `now` is time.monotonic()."""

    def request_added(self, request_id: str, num_prompt_tokens: int, now: float) -> None: ...
    def request_aborted(self, request_id: str, now: float) -> None: ...
    def step_done(self, outputs: list, now: float) -> None: ...


# get_metrics() keys that describe what the engine holds now (the rest are counters and the plan):
# they read 0 once the loop has stopped, so a dead engine's gauges do not show stale work.
OCCUPANCY_KEYS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_free", "num_slots_used",
                  "num_slots_free", "kv_blocks_cached", "prefix_checkpoints_cached")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or a step raised)."""


class EngineLoop:
    """Owns an LLMEngine and steps it on one background thread while it has work.

    From start() to shutdown() the loop thread is the engine's only caller: offline work goes
    through `generate()` (or `call()`), never through LLM.generate() on the same engine."""

    def __init__(self, engine, observer: LoopObserver | None = None):
        self.engine = engine
        self.observer = observer
        self.error: BaseException | None = None
        self.metrics_snapshot: dict = dict(engine.get_metrics())
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replayssm-engine-loop", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping.is_set()

    @property
    def num_in_flight(self) -> int:
        """Requests added through this loop that have neither finished nor been aborted."""
        return len(self._sinks)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight get EngineDeadError through their sinks."""
        self._stopping.set()
        self._commands.put(None)  # wake a loop blocked on an empty queue
        if self._thread.is_alive():
            self._thread.join(timeout)

    def add_group(self, requests: list[tuple[str, Any, Any, int]],
                  sinks: list[Sink]) -> concurrent.futures.Future:
        """Add (request_id, prompt, params, num_prompt_tokens) requests all or nothing, as one client
        request: the scheduler shares admission fairly between groups (the first id names the group).

        The future resolves once the engine accepted every request, or fails with the engine's
        ValueError (after aborting the ones already added)."""
        return self._submit(("add", requests, sinks))

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; their sinks hear nothing more."""
        if self.alive:
            self._commands.put((concurrent.futures.Future(), ("abort", request_ids)))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the loop thread between steps (e.g. to inspect pools safely)."""
        return self._submit(("call", fn))

    def generate(self, request_id: str, prompt, params) -> concurrent.futures.Future:
        """Offline use of the same loop: a future of the request's final RequestOutput."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def sink(item) -> None:
            if isinstance(item, BaseException):
                done.set_exception(item)
            elif item.finished:
                done.set_result(item)

        def rejected(added: concurrent.futures.Future) -> None:
            if added.exception() is not None:
                done.set_exception(added.exception())

        self.add_group([(request_id, prompt, params, 0)], [sink]).add_done_callback(rejected)
        return done

    def _submit(self, command: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineDeadError("engine loop is not running"))
        else:
            self._commands.put((future, command))
        return future

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                # Block only when idle; with work in flight, apply commands without waiting.
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set() or not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self.metrics_snapshot = dict(self.engine.get_metrics())
                self._dispatch(outputs)
        except Exception as exc:  # a step failure must reach every waiting client, not kill silently
            logger.exception("engine loop stopped")
            self.error = exc
        finally:
            self._stopping.set()
            self.metrics_snapshot = {**self.metrics_snapshot,
                                     **{k: 0 for k in OCCUPANCY_KEYS if k in self.metrics_snapshot}}
            self._fail_everything(self.error or EngineDeadError("engine loop shut down"))

    def _apply_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            future, command = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._apply(command))
                except Exception as exc:  # the caller's failure (bad input, a failed check), not the loop's
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> Any:
        kind = command[0]
        if kind == "call":
            return command[1](self.engine)
        if kind == "abort":
            for request_id in command[1]:
                if self._sinks.pop(request_id, None) is not None:
                    self.engine.abort_request(request_id)
                    if self.observer:
                        self.observer.request_aborted(request_id, time.monotonic())
            return None
        _, requests, sinks = command
        added: list[str] = []
        try:
            for (request_id, prompt, params, num_prompt_tokens), sink in zip(requests, sinks):
                if request_id in self._sinks:
                    raise ValueError(f"request_id {request_id!r} is already running")
                self.engine.add_request(request_id, prompt, params, parent_id=requests[0][0])
                added.append(request_id)
                self._sinks[request_id] = sink
                if self.observer:
                    self.observer.request_added(request_id, num_prompt_tokens, time.monotonic())
        except Exception:
            self._apply(("abort", added))
            raise
        return None

    def _dispatch(self, outputs: list) -> None:
        if self.observer:
            self.observer.step_done(outputs, time.monotonic())
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                sink(out)

    def _fail_everything(self, exc: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(exc)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0].set_running_or_notify_cancel():
                item[0].set_exception(EngineDeadError("engine loop shut down"))


class RequestGroup:
    """The asyncio side of one HTTP request's sub-requests (prompts x n), indexed 0..k-1."""

    def __init__(self, request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self.request_ids = request_ids
        self.latest: list[Any] = [None] * len(request_ids)
        self.finished = [False] * len(request_ids)
        self._pending: set[int] = set()
        self._error: BaseException | None = None
        self._stopped = False
        self._event = asyncio.Event()
        self._loop = loop

    @property
    def done(self) -> bool:
        return all(self.finished)

    def stop(self) -> None:
        """End `updates()` after the outputs already delivered (the server is shutting down); the
        caller aborts the sub-requests in the engine."""
        self._stopped = True
        self._event.set()

    def sink(self, index: int) -> Sink:
        def deliver_threadsafe(item) -> None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, index, item)
            except RuntimeError:  # the event loop closed under us (server shutting down)
                pass
        return deliver_threadsafe

    def _deliver(self, index: int, item) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self.latest[index] = item
            self.finished[index] = item.finished
            self._pending.add(index)
        self._event.set()

    async def updates(self) -> AsyncIterator[list[int]]:
        """Yield the indices with a new output, until every sub-request finished or stop()."""
        while True:
            # Outputs may have arrived before the consumer started: drain before waiting.
            if self._error is not None:
                raise EngineDeadError(f"engine loop stopped: {self._error!r}") from self._error
            if self._pending:
                ready, self._pending = sorted(self._pending), set()
                yield ready
            elif self.done or self._stopped:
                return
            else:
                await self._event.wait()
                self._event.clear()


class AsyncEngine:
    """asyncio front of an EngineLoop: add a group of requests, iterate its updates, abort it."""

    def __init__(self, engine_loop: EngineLoop):
        self.engine_loop = engine_loop

    async def add(self, requests: list[tuple[str, Any, Any, int]]) -> RequestGroup:
        """Add requests (id, prompt, params, num_prompt_tokens); raises the engine's ValueError."""
        group = RequestGroup([r[0] for r in requests], asyncio.get_running_loop())
        sinks = [group.sink(i) for i in range(len(requests))]
        try:
            await asyncio.wrap_future(self.engine_loop.add_group(requests, sinks))
        except asyncio.CancelledError:
            # The loop may have added them before we were cancelled; never leave them orphaned.
            self.engine_loop.abort(group.request_ids)
            raise
        return group

    def abort(self, group: RequestGroup) -> None:
        """Abort the group's unfinished sub-requests (client went away); never blocks."""
        ids = [rid for rid, fin in zip(group.request_ids, group.finished) if not fin]
        if ids:
            self.engine_loop.abort(ids)
