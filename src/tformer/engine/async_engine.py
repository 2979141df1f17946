"""`AsyncEngine`: one background thread owns the `Engine`; asyncio code talks to it through queues.

The `Engine` is not thread-safe, so only its thread ever touches it. Callers put commands (add, abort, stop)
on a thread-safe queue; the thread applies them between steps and hands each request's outputs to that
request's own asyncio queue with `loop.call_soon_threadsafe`. With nothing to run, the thread blocks on the
command queue, so an idle server uses no CPU.

A server builds its engine with `AsyncEngine.launch`, on the thread that will run it, so that torch computes on one
thread only. Each thread that runs torch ops gets its own OpenMP team; once two teams exist, libgomp counts more threads
than cores and stops spin-waiting between parallel regions, so every small op of a decode step waits on a futex wake-up,
which made batch-1 decoding far slower on 2 cores (docs/design-notes.md, "engine/async_engine.py").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from tformer.engine import Engine, RequestError, RequestOutput, SamplingParams
from tformer.engine.embedding import EmbeddingEngine
from tformer.engine.requests import ContextWindow
from tformer.engine.sampler import isolated

logger = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine stopped (the server is shutting down, or a step failed) before the request finished."""


class EngineBusy(RuntimeError):
    """More requests wait than `max_waiting` allows: the caller should retry later."""


class RequestFailed(RuntimeError):
    """The request failed alone (the engine went on with the others); `client_error` when its own parameters were
    at fault rather than the server."""

    def __init__(self, message: str, client_error: bool = False) -> None:
        super().__init__(message)
        self.client_error = client_error


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's books, published by its thread after every step and command."""

    waiting: int = 0
    running: int = 0
    blocks_in_use: int = 0
    blocks_total: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # speculative decoding: draft tokens proposed, and how many the target accepted
    accepted_draft_tokens: int = 0


class _Sink:
    """Carries one request's events (acceptance, outputs, errors) from the engine thread to its event loop.

    A request with n samples ends when all n have finished; `unfinished` is the engine thread's count.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, samples: int) -> None:
        self.loop = loop
        self.samples = samples
        self.unfinished = samples
        self.queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: _Sink
    deadline: float | None = None  # time.monotonic() after which the request ends with finish_reason "timeout"


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


class _Stop:
    pass


_ACCEPTED = None  # the first event of an accepted request
_ENDED = object()  # `stream_all`: one of its requests has finished


class AsyncEngine:
    """Serves many asyncio callers from one `Engine` running in one background thread.

    `await add(...)` queues a request (raising `RequestError` when the engine refuses it); `stream(id)` yields
    its `RequestOutput`s and aborts the request if the caller stops early; `generate(...)` does both.

    Limits: with `max_waiting`, a request beyond `max_seqs` running and `max_waiting` waiting is refused with
    `EngineBusy`; with `request_timeout` (seconds), a request still unfinished that long after it was added ends
    with finish_reason "timeout" and its blocks return to the pool. A request that fails alone ends with
    `RequestFailed`; if the engine thread dies anyway, every request waiting on it gets `EngineStopped` at once.
    """

    def __init__(
        self, engine: Engine | EmbeddingEngine, max_waiting: int | None = None, request_timeout: float | None = None
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout
        self._deadlines: dict[str, float] = {}  # the engine thread's: request id -> when it times out
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | _Stop] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # the callers' side: touched only from event loops
        self.num_cancelled = 0  # requests that ended before finishing (the caller left, or the engine stopped)
        self._live: dict[str, _Sink] = {}  # the engine thread's side
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()  # no add can slip in behind the stop command
        self._stats = EngineStats(blocks_total=engine.allocator.pool.num_blocks if engine.generates else 0)

    @classmethod
    def launch(cls, build: Callable[[], Engine | EmbeddingEngine], **limits: Any) -> AsyncEngine:
        """Runs `build()` on a new engine thread, then serves from that thread; returns once the engine is built
        (or raises what `build` raised). Loading, warm-up and every step then share one OpenMP team. `limits` are
        `max_waiting` and `request_timeout`."""
        built: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()

        def build_and_run() -> None:
            try:
                async_engine = cls(build(), **limits)
            except BaseException as err:  # noqa: BLE001 -- handed to the caller waiting on `built`
                built.set_exception(err)
                return
            async_engine._thread = threading.current_thread()
            built.set_result(async_engine)
            async_engine._run()

        threading.Thread(target=build_and_run, name="tformer-engine", daemon=True).start()
        return built.result()

    # the callers' side -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tformer-engine", daemon=True)
            self._thread.start()

    def _capacity(self) -> int:
        """Requests that may be in flight at once: `max_seqs` running and `max_waiting` waiting."""
        running = self.engine.config.max_seqs if self.engine.generates else 0
        return running + (self.max_waiting or 0)

    def stop(self) -> None:
        """Tells the engine thread to stop without waiting for it (safe from an event loop): requests still in
        flight end with `EngineStopped`. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(_Stop())

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the engine thread and waits for it; requests still in flight end with `EngineStopped`."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def context(self) -> ContextWindow:
        """The engine's context-length rule, to apply before a request is queued (it reads only the engine's
        configuration: safe from any thread)."""
        return self.engine.context

    async def add(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        """Queues a request and waits until the engine takes it; raises `RequestError` if it refuses."""
        if request_id in self._sinks:
            raise RequestError(f"request id {request_id!r} is already in use")
        if self.max_waiting is not None and len(self._sinks) >= self._capacity():
            raise EngineBusy(f"{len(self._sinks)} requests are in flight, {self.max_waiting} of them may wait; retry")
        sink = _Sink(asyncio.get_running_loop(), params.n)
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        with self._lock:
            if self._closed or not self.is_running:
                raise EngineStopped("the engine is not running (the server is shutting down)")
            self._sinks[request_id] = sink
            self._commands.put(_Add(request_id, prompt, params, sink, deadline))
        try:
            event = await sink.queue.get()
        except BaseException:  # cancelled while waiting: the add may still land, so abort it behind the add
            self._drop(request_id)
            raise
        if event is not _ACCEPTED:  # refused: nothing to abort
            self._sinks.pop(request_id, None)
            raise event if isinstance(event, BaseException) else EngineStopped(f"unexpected event {event!r}")

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields an added request's outputs until every sample finishes; leaving early aborts it and frees its
        blocks."""
        sink = self._sinks[request_id]
        unfinished = sink.samples
        finished = False
        try:
            while not finished:
                event = await sink.queue.get()
                if isinstance(event, BaseException):
                    raise event
                if event is _ACCEPTED:
                    continue
                unfinished -= event.finished
                finished = not unfinished
                yield event
        finally:
            if finished:
                self._sinks.pop(request_id, None)
            else:
                self._drop(request_id)

    async def stream_all(self, request_ids: list[str], n: int) -> AsyncIterator[RequestOutput]:
        """The outputs of several added requests of `n` samples each (a batch of prompts) as one request's, as they
        come: sample j of request i becomes index i * n + j (OpenAI's choice order). Leaving early aborts them all."""
        if len(request_ids) == 1:
            async with aclosing(self.stream(request_ids[0])) as outputs:
                async for output in outputs:
                    yield output
            return
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, request_id: str) -> None:
            try:
                async for output in self.stream(request_id):
                    events.put_nowait(replace(output, index=i * n + output.index))
            except Exception as err:  # noqa: BLE001 -- handed to the reader, which raises it
                events.put_nowait(err)
            events.put_nowait(_ENDED)

        pumps = [asyncio.ensure_future(pump(i, request_id)) for i, request_id in enumerate(request_ids)]
        try:
            running = len(pumps)
            while running:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                if event is _ENDED:
                    running -= 1
                    continue
                yield event
        finally:
            for task in pumps:
                task.cancel()  # a stream left unfinished aborts its request
            await asyncio.gather(*pumps, return_exceptions=True)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """`add` then `stream`: the request's outputs as the engine produces them."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        await self.add(request_id, prompt, params)
        async for output in self.stream(request_id):
            yield output

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn()` on the engine thread between two steps and returns its result (or raises its error): for work
        on the engine's model outside its batch, such as a translation's cross-attention map."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or not self.is_running:
                raise EngineStopped("the engine is not running (the server is shutting down)")
            self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Cancels a request from any thread; its KV blocks return to the pool at the engine's next turn."""
        self._commands.put(_Abort(request_id))

    def release(self, request_id: str) -> None:
        """Aborts a request unless its stream was read to the end (e.g. a stream that never started)."""
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self.num_cancelled += 1
            self.abort(request_id)

    # the engine thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        running, farewell = True, "the server is shutting down; the request was cancelled"
        try:
            while running:
                try:
                    running = self._apply_commands(block=not self.engine.has_unfinished())
                    self._expire()
                    if running and self.engine.has_unfinished():
                        self._step()
                except BaseException as err:  # a failed step must not kill the server's only engine thread
                    if not isolated(err):
                        farewell = f"the engine stopped: {type(err).__name__}"
                        raise
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(EngineStopped(f"the engine failed: {type(err).__name__}: {err}"))
                self._publish_stats()
        finally:  # however the thread ends, nobody waits on it: in flight, or still in the command queue
            with self._lock:
                self._closed = True
            self._fail_all(EngineStopped(farewell))
            self._fail_queued(EngineStopped(farewell))
            self._publish_stats()

    def _apply_commands(self, block: bool) -> bool:
        """Applies every queued command (waiting for one if `block`); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
            while True:
                if isinstance(command, _Stop):
                    return False
                self._apply(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn())
                except BaseException as err:  # the caller gets it
                    if not isolated(err):
                        raise
                    command.future.set_exception(err if isinstance(err, Exception) else RuntimeError(repr(err)))
            return
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            self._live.pop(command.request_id, None)
            self._deadlines.pop(command.request_id, None)
            return
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id)
        except RequestError as err:
            command.sink.put(err)
            return
        except BaseException as err:  # the engine's fault, not the request's: this request fails alone
            if not isolated(err):
                raise
            logger.exception("adding request %s failed", command.request_id)
            command.sink.put(RequestFailed(f"the engine could not add the request: {type(err).__name__}: {err}"))
            return
        self._live[command.request_id] = command.sink
        if command.deadline is not None:
            self._deadlines[command.request_id] = command.deadline
        command.sink.put(_ACCEPTED)

    def _step(self) -> None:
        self._deliver(self.engine.step())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._live.get(output.request_id)
            if sink is None:
                continue
            if output.error is not None:  # failed alone: its samples all end with the error
                sink.put(RequestFailed(output.error.message, output.error.client_error))
                sink.unfinished = 0
            else:
                sink.put(output)
                sink.unfinished -= output.finished
            if not sink.unfinished:
                del self._live[output.request_id]
                self._deadlines.pop(output.request_id, None)
                self.engine.abort(output.request_id)  # every sample finished: this only forgets their books

    def _expire(self) -> None:
        """Ends the requests whose deadline has passed, with finish_reason "timeout"."""
        if not self._deadlines:
            return
        now = time.monotonic()
        for request_id in [rid for rid, deadline in self._deadlines.items() if deadline <= now]:
            self._deadlines.pop(request_id)
            self._deliver(self.engine.finish_request(request_id, "timeout"))

    def _fail_queued(self, error: EngineStopped) -> None:
        """Answers the commands still queued behind a stop: their callers would wait forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.sink.put(error)
            elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)

    def _fail_all(self, error: EngineStopped) -> None:
        for request_id, sink in list(self._live.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 -- keep failing the others
                logger.exception("could not abort %s", request_id)
            sink.put(error)
        self._live.clear()
        self._deadlines.clear()

    def _publish_stats(self) -> None:
        engine = self.engine
        if not engine.generates:  # an encoder's: no requests, no blocks
            return
        self._stats = EngineStats(
            waiting=len(engine.scheduler.waiting),
            running=len(engine.scheduler.running),
            blocks_in_use=engine.num_blocks_in_use,
            blocks_total=engine.allocator.pool.num_blocks,
            preemptions=engine.num_preemptions,
            draft_tokens=engine.speculative.proposed,
            accepted_draft_tokens=engine.speculative.accepted,
        )
