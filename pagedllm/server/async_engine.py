"""The engine on a thread of its own, driven from asyncio through a command queue.

``LLMEngine`` is not thread-safe, so exactly one thread (the loop thread) touches it:
HTTP handlers put add/abort commands on a ``queue.Queue``; the loop thread applies
them between steps, runs ``step()`` while anything is unfinished, and hands outputs
back to the event loop, where one ``asyncio.Queue`` per HTTP request feeds its
handler. With nothing to run, the loop thread blocks on the command queue (no
polling). Chat templates and tokenization also run on the loop thread, so the
tokenizer never encodes on two threads at once. Other work on engine state (the
dashboard's feed, a prefix-cache reset) goes the same way: :meth:`AsyncEngine.call`.

Failures, from the smallest to the largest:
- A request the engine refuses (bad field, too long, worst case beyond the pool) gets
  a 400 naming the field; anything else raised while adding it, a 500; both alone.
- A request the engine fails inside a step (``RequestOutput.error``) gets a 500 (an
  error event when streamed); the rest of the batch goes on.
- A step that raises for no single request fails every request in flight with a 500
  and the loop goes on, provided the engine is then empty with every block free.
- Anything else that escapes the loop (or an engine that is not clean after a failed
  step) ends the loop thread for good: every waiting request gets a 503, new ones get
  503, ``is_running`` turns false (``/health`` answers 503) and ``on_loop_death`` is
  called on the event loop so that the server can exit non-zero and be restarted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from jinja2 import TemplateError

from pagedllm.distributed.errors import WorkerFailedError
from pagedllm.engine.block_size_choice import RequestLengthLog
from pagedllm.engine.llm_engine import LLMEngine, PromptInput
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.server.errors import APIError
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.reply_size import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    check_logprob_entries,
    logprob_entries,
)

logger = logging.getLogger("pagedllm.server")

METRICS_INTERVAL_S = 0.5
"""Seconds between engine snapshots for /metrics while requests run."""

DISCONNECT_POLL_S = 0.5
"""How often a waiting consumer asks whether its client is still connected and the
loop thread still alive."""


@dataclass(frozen=True)
class ChatPrompt:
    """Messages (and the tools, for templates that render them) to render with the
    model's chat template (on the loop thread)."""

    messages: list[dict[str, object]]
    tools: list[dict[str, object]] | None = None


EnginePrompt = PromptInput | Sequence[int] | ChatPrompt


@dataclass
class RequestGroup:
    """The engine requests of one HTTP request (one per prompt of a batch).

    ``items`` receives ``(request_id, item)`` pairs from the loop thread: first
    ``_ACCEPTED`` or an ``APIError`` per request, then ``RequestOutput`` snapshots
    until each is finished (or an ``APIError`` if the engine fails). ``items`` is
    None once the group is released.
    """

    request_ids: list[str]
    items: asyncio.Queue | None = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    logprob_entries: int = 0
    """The worst-case logprob entries of the requests added so far (loop thread)."""


@dataclass
class _Add:
    request_id: str
    prompt: EnginePrompt
    params: SamplingParams
    arrival_time: float
    group: RequestGroup


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    """Abort whatever is still running and end the loop thread."""


@dataclass
class _Call:
    """Run ``function`` in the loop thread; its result (or error) then settles
    ``future`` on the event loop, if given. An error never reaches the loop itself."""

    function: Callable[[], object]
    future: asyncio.Future | None = None


class LoopObserver(Protocol):
    """Follows the loop thread: ``after_pass(stepped)`` after every pass (a step, or
    commands applied while idle); an idle loop waits at most ``wait_timeout()``
    seconds for a command (None: as long as it takes)."""

    def after_pass(self, stepped: bool) -> None: ...

    def wait_timeout(self) -> float | None: ...


_ACCEPTED = object()


class EngineUnclean(RuntimeError):
    """After a failed step and aborting everything, the engine still holds requests or
    blocks: its state cannot be trusted, so the loop stops."""


class AsyncEngine:
    """Owns the loop thread; every public method is called from the event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics,
        max_pending_requests: int,
        on_loop_death: Callable[[], None] | None = None,
        max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
        lengths: RequestLengthLog | None = None,
    ) -> None:
        """``max_pending_requests``: engine requests admitted and not yet finished
        (queued, waiting or running) beyond which new HTTP requests get 503.
        ``on_loop_death``: called once on the event loop if the loop thread dies.
        ``max_logprob_entries``: the most logprob entries one HTTP request may ask
        for (:mod:`pagedllm.server.reply_size`), beyond which it gets 400.
        ``lengths``: where the prompt and output lengths of finished requests are
        recorded (for ``block_size="auto"`` at the next start)."""
        self.engine = engine
        self.metrics = metrics
        self.max_pending_requests = max_pending_requests
        self.max_logprob_entries = max_logprob_entries
        self.lengths = lengths
        self._on_loop_death = on_loop_death
        self.loop_died = False  # set once, by the loop thread
        self._commands: queue.Queue[_Add | _Abort | _Stop | _Call] = queue.Queue()
        self.observer: LoopObserver | None = None  # set before start()
        self._groups: dict[str, RequestGroup] = {}  # loop thread only
        self._num_pending = 0  # event loop only
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False  # event loop only
        self._stopping: asyncio.Future | None = None  # event loop only

    # ---- lifecycle (event loop) -------------------------------------------------------

    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self._accepting = True

    async def stop(self) -> None:
        """Refuse new requests, abort what still runs (its clients get a 503, streams
        an error event), end the loop thread and wait for it; safe to call again or
        concurrently."""
        await asyncio.shield(self._begin_stop())

    def _begin_stop(self) -> asyncio.Future:
        self._accepting = False
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_thread())
        return self._stopping

    async def _stop_thread(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.engine.shutdown()
        if self.lengths is not None:
            self.lengths.close()

    def stop_after(self, delay_s: float) -> None:
        """Call :meth:`stop` ``delay_s`` seconds from now; safe from any thread (a
        signal handler included). The grace period of a graceful shutdown."""
        loop = self._event_loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(loop.call_later, delay_s, self._begin_stop)

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and new requests are accepted."""
        return self._accepting and self._thread_alive

    @property
    def _thread_alive(self) -> bool:
        return not self.loop_died and self._thread is not None and self._thread.is_alive()

    def unavailable(self) -> APIError:
        """The 503 for a request that arrives (or waits) while the loop is not running."""
        if self.loop_died:
            return APIError(
                503,
                "The engine loop has stopped; this server is exiting so that it can be "
                "restarted",
                code="engine_dead",
            )
        return APIError(503, "The server is shutting down", code="shutting_down")

    # ---- requests (event loop) --------------------------------------------------------

    async def add_group(
        self,
        request_ids: list[str],
        prompts: list[EnginePrompt],
        params: SamplingParams,
        arrival_time: float,
    ) -> RequestGroup:
        """Queue one engine request per prompt and wait until the engine accepts all.

        Raises APIError: 503 when the pending limit is reached or the loop has stopped,
        400 when the engine rejects a prompt (too long, empty, ...); then nothing of
        the group stays queued.
        """
        if not self.is_running:
            raise self.unavailable()
        if self._num_pending + len(prompts) > self.max_pending_requests:
            raise APIError(
                503,
                f"The server is at its limit of {self.max_pending_requests} pending "
                "requests; retry later",
                code="queue_full",
            )
        group = RequestGroup(list(request_ids), unfinished=set(request_ids))
        self._num_pending += len(request_ids)
        for request_id, prompt in zip(request_ids, prompts, strict=True):
            self._commands.put(_Add(request_id, prompt, params, arrival_time, group))
        error: APIError | None = None
        try:
            for _ in request_ids:
                _, item = await self._next_item(group)
                if isinstance(item, APIError):
                    error = error or item
        except BaseException:
            self.abort(group)
            raise
        if error is not None:
            self.abort(group)
            raise error
        return group

    async def outputs(
        self,
        group: RequestGroup,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The group's snapshots until every request finishes.

        Every ``DISCONNECT_POLL_S`` seconds, whether or not outputs arrive meanwhile,
        it checks that the loop thread lives (503 otherwise) and that the client is
        still there (``is_disconnected``). Leaving early (a break, cancellation,
        the client gone) aborts the unfinished requests, freeing their blocks at the
        engine's next command check.
        """
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while group.unfinished:
                item = await _get_until(group.items, next_check)
                if time.monotonic() >= next_check:
                    if not self._thread_alive:
                        raise self.unavailable()
                    if is_disconnected is not None and await is_disconnected():
                        return
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                if item is None:
                    continue
                request_id, output = item
                if isinstance(output, APIError):
                    raise output
                if output.finished:
                    group.unfinished.discard(request_id)
                yield output
        finally:
            self.abort(group)

    async def _next_item(self, group: RequestGroup) -> tuple[str, object]:
        """The group's next item; a 503 if the loop thread dies while we wait."""
        while True:
            item = await _get_until(group.items, time.monotonic() + DISCONNECT_POLL_S)
            if item is not None:
                return item
            if not self._thread_alive:
                raise self.unavailable()

    def abort(self, group: RequestGroup) -> None:
        """Abort the group's unfinished requests and release it; idempotent."""
        for request_id in group.unfinished:
            self._commands.put(_Abort(request_id))
        group.unfinished.clear()
        if group.items is not None:
            self._num_pending -= len(group.request_ids)
            group.items = None

    def call(self, function: Callable[[], object]) -> None:
        """Run ``function`` in the loop thread, between steps (event loop)."""
        self._commands.put(_Call(function))

    async def call_and_wait(self, function: Callable[[], object]) -> object:
        """Run ``function`` in the loop thread and return its result (event loop);
        raises the 503 of :meth:`unavailable` when the loop is not running."""
        if not self.is_running:
            raise self.unavailable()
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(function, future))
        return await future

    # ---- the loop thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            logger.critical("the engine loop died; failing every request", exc_info=True)
            self.loop_died = True
            self._fail_everything()

    def _serve(self) -> None:
        engine = self.engine
        last_metrics = 0.0
        was_idle = True
        observer = self.observer
        while True:
            idle_wait = None if observer is None else observer.wait_timeout()
            if not self._apply_commands(not engine.has_unfinished_requests(), idle_wait):
                return
            stepped = engine.has_unfinished_requests()
            if stepped:
                try:
                    outputs = engine.step()
                except WorkerFailedError:
                    raise  # a lost rank ends the engine: the loop dies, the server exits
                except Exception:
                    logger.exception("engine step failed; failing the requests in flight")
                    self.metrics.step_failed()
                    self._abort_all(
                        APIError(
                            500,
                            "The engine failed while running this request",
                            code="internal_error",
                        )
                    )
                    self._check_clean()
                    continue
                self._dispatch(outputs)
            if observer is not None:
                observer.after_pass(stepped)
            now = time.monotonic()
            idle = not engine.has_unfinished_requests()
            if idle or was_idle or now - last_metrics >= METRICS_INTERVAL_S:
                # the snapshot walks every live table: build it when due, on the first
                # step after a rest (so the gauges never show a busy engine as idle) and
                # at rest (so the counters are exact once the engine is idle)
                self.metrics.record_step(engine.get_stats())
                last_metrics = now
            was_idle = idle

    def _check_clean(self) -> None:
        """Raise EngineUnclean unless the engine is empty with every block free."""
        engine = self.engine
        used = engine.block_manager.pool.num_used
        if engine.has_unfinished_requests() or used:
            raise EngineUnclean(
                f"after a failed step the engine still holds {used} blocks "
                f"(unfinished requests: {engine.has_unfinished_requests()})"
            )

    def _fail_everything(self) -> None:
        """After the loop died: a 503 to every request in flight or queued, then tell
        the event loop. Touches no engine state."""
        error = self.unavailable()
        deliveries = [(group, request_id, error) for request_id, group in self._groups.items()]
        self._groups.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                deliveries.append((command.group, command.request_id, error))
        self._send(deliveries)
        loop = self._event_loop
        if self._on_loop_death is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_loop_death)

    def _apply_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands, waiting for one (at most ``timeout`` seconds) if
        ``block``; False once stopped."""
        try:
            command = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                # Nothing is added after _Stop: stop() stops accepting before sending it.
                self._abort_all(APIError(503, "The server is shutting down", code="shutting_down"))
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        try:
            prompt = command.prompt
            if isinstance(prompt, ChatPrompt):
                text = None
                ids = self.engine.tokenizer.apply_chat_template(
                    prompt.messages, tools=prompt.tools
                )
            else:
                text, ids = self.engine.tokenize_prompt(prompt)
            self._charge_logprobs(command, len(ids))
            self.engine.add_request(
                command.request_id,
                {"prompt": text, "prompt_token_ids": ids},
                command.params,
                arrival_time=command.arrival_time,
            )
        except (ValueError, TemplateError) as error:
            param = error.param if isinstance(error, InvalidRequestError) else None
            refused = APIError(400, str(error), param=param, code="invalid_value")
            self._send([(command.group, command.request_id, refused)])
            return
        except Exception:
            logger.exception("adding request %s failed", command.request_id)
            self.engine.abort_request(command.request_id)
            failed = APIError(
                500, "The engine failed while admitting this request", code="internal_error"
            )
            self._send([(command.group, command.request_id, failed)])
            return
        self._groups[command.request_id] = command.group
        self.metrics.request_added(command.request_id)
        self._send([(command.group, command.request_id, _ACCEPTED)])

    def _call(self, command: _Call) -> None:
        result, error = None, None
        try:
            result = command.function()
        except Exception as raised:
            logger.exception("a call run in the engine loop failed")
            error = raised
        loop = self._event_loop
        if command.future is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_settle, command.future, result, error)

    def _charge_logprobs(self, command: _Add, prompt_len: int) -> None:
        """Add the request's worst-case logprob entries to its group's; raises
        InvalidRequestError past ``max_logprob_entries``."""
        params = command.params
        entries = logprob_entries(params, prompt_len, self.engine.max_model_len)
        command.group.logprob_entries += entries
        check_logprob_entries(params, command.group.logprob_entries, self.max_logprob_entries)

    def _abort(self, request_id: str) -> None:
        if self._groups.pop(request_id, None) is None:
            return
        self.engine.abort_request(request_id)
        self.metrics.request_aborted(request_id)

    def _abort_all(self, error: APIError) -> None:
        """Abort every request in flight and end each one's stream with ``error``."""
        deliveries = [(group, request_id, error) for request_id, group in self._groups.items()]
        for request_id in list(self._groups):
            self._abort(request_id)
        self._send(deliveries)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deliveries = []
        for output in outputs:
            group = self._groups.get(output.request_id)
            if group is None:
                continue
            if output.error is not None:
                del self._groups[output.request_id]
                self.metrics.request_failed(output.request_id)
                failure = APIError(
                    500,
                    f"The engine failed on this request: {output.error}",
                    code="internal_error",
                )
                deliveries.append((group, output.request_id, failure))
                continue
            self.metrics.request_progressed(output, now)
            if output.finished:
                del self._groups[output.request_id]
                if self.lengths is not None:  # one sequence per completion
                    for completion in output.outputs:
                        prompt = len(output.prompt_token_ids or ())
                        self.lengths.add(prompt, len(completion.token_ids))
            deliveries.append((group, output.request_id, output))
        self._send(deliveries)

    def _send(self, deliveries: list[tuple[RequestGroup, str, object]]) -> None:
        """Hand items to their groups on the event loop, in order, in one callback."""
        loop = self._event_loop
        if deliveries and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_deliver, deliveries)


async def _get_until(items: asyncio.Queue, deadline: float) -> tuple[str, object] | None:
    """The queue's next item, or None if none comes before ``deadline`` (monotonic s)."""
    if not items.empty():
        return items.get_nowait()
    try:
        return await asyncio.wait_for(items.get(), max(deadline - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        return None


def _settle(future: asyncio.Future, result: object, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _deliver(deliveries: list[tuple[RequestGroup, str, object]]) -> None:
    for group, request_id, item in deliveries:
        if group.items is not None:
            group.items.put_nowait((request_id, item))
