"""The engine loop beside an asyncio app: one thread owns the LLMEngine and steps it; coroutines
submit requests and aborts through a queue and receive each request's outputs on their own queue.

That thread also builds the engine: every torch op then runs on one thread and its OpenMP team.
Loading the model on the main thread gave that thread a second team, and with two teams on two
cores each parallel op of the loop thread ran about 40% slower (a decode step 57 ms instead of 41)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from baton.engine.engine import LLMEngine, Prompt, StepFailed
from baton.handoff.errors import InvalidKVImport
from baton.handoff.validate import ImportPlan
from baton.outputs import RequestOutput
from baton.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or its thread died): nothing can be served."""


class RequestFailedError(RuntimeError):
    """This request's engine step raised; the engine goes on serving the others."""


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: concurrent.futures.Future
    kv_import: ImportPlan | None = None
    export_kv: str | None = None


class AsyncEngine:
    def __init__(self, make_engine: Callable[[], LLMEngine], stall_timeout_s: float = 60.0) -> None:
        """Starts the loop thread, which calls `make_engine`; returns once the engine is built
        (re-raising its error). Requests are served after `start()`. The loop is stalled (and
        `/health` says so) while work is pending and no step has moved for `stall_timeout_s`."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._started = threading.Event()
        self._stopping = threading.Event()
        self.running = False
        self.dead = False  # the loop thread died of a bug: /health and every new request say 503
        self.stall_timeout_s = stall_timeout_s
        self.stalled = False
        self.stalls = 0
        self.rejected_imports = 0  # spans refused before the engine saw them (event loop thread)
        self.refused_first_tokens = 0  # spans whose first token the request forbids (engine thread)
        self.step_failures = 0
        # spans are verified and converted here, never on the engine thread: a 2 GiB span's HMAC,
        # checksums and conversion would stall every decode
        self._verify_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-kv-verify")
        # requests handed to the loop thread and taken from the inbox: each counter has one writer thread
        self._submitted = 0
        self._taken = 0
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(make_engine, built), name="baton-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()

    def start(self) -> None:
        self.running = True
        self._started.set()

    def stop(self) -> None:
        """Abort whatever is left and end the loop thread."""
        self._stopping.set()
        self._started.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.running = False
        self._verify_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        kv_span: bytes | None = None,
        export_kv: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as it advances. Leaving early (client gone) aborts it.
        A `kv_span` that fails validation is counted and the prompt is prefilled here instead."""
        self.check_alive()
        loop = asyncio.get_running_loop()
        kv_import = await self._verify(prompt, kv_span) if kv_span is not None else None
        outputs: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._submitted += 1
        self._inbox.put(_Add(request_id, prompt, params, outputs, loop, accepted, kv_import, export_kv))
        self._wake.set()
        finished = False
        try:
            await asyncio.wrap_future(accepted)  # raises the engine's ValueError for a bad request
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added just before the cancel
            raise
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def _verify(self, prompt: Prompt, blob: bytes) -> ImportPlan | None:
        """The span's import plan, checked on the verify thread; None (prefill here) if refused."""

        def plan() -> ImportPlan:
            return self.engine.handoff.plan(blob, self.engine.inputs.tokenize(prompt)[1])

        try:
            return await asyncio.get_running_loop().run_in_executor(self._verify_pool, plan)
        except InvalidKVImport as e:
            self.rejected_imports += 1
            logger.warning("a KV span was refused (%s); prefilling locally", e)
            return None

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def check_alive(self) -> None:
        if not self.running or self.dead:
            raise EngineDeadError("the engine loop is not running")

    def num_waiting(self) -> int:
        """Requests submitted and not yet running (read from the event loop thread: a close estimate)."""
        return self._submitted - self._taken + len(self.engine.scheduler.waiting)

    # ---- the loop thread -------------------------------------------------------------------------
    def _drain_inbox(self, reject: bool = False) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Add):
                self._taken += 1
                if not item.accepted.set_running_or_notify_cancel():
                    continue  # its client left before the request was taken
                if reject:
                    item.accepted.set_exception(EngineDeadError("the server is shutting down"))
                    continue
                try:
                    self._add(item)
                except Exception as e:  # a bad request fails alone
                    item.accepted.set_exception(e)
                    continue
                self._streams[item.request_id] = (item.loop, item.outputs)
                item.accepted.set_result(None)
            else:
                rid = item[1]
                self.engine.abort_request(rid)
                self._streams.pop(rid, None)

    def _add(self, item: _Add) -> None:
        if item.kv_import is not None:
            try:
                self.engine.add_request(item.prompt, item.params, item.request_id, kv_import=item.kv_import)
                return
            except InvalidKVImport as e:  # nothing was taken: prefill it here instead
                self.refused_first_tokens += 1
                logger.warning("request %s: %s; prefilling locally", item.request_id, e)
        self.engine.add_request(item.prompt, item.params, item.request_id, export_kv=item.export_kv)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, outputs = stream
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # that request's event loop is closed
            pass

    def _main(self, make_engine: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            engine = make_engine()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(engine)
        if engine.ranks is not None:
            engine.ranks.on_lost.append(self._ranks_lost)
        self._started.wait()
        try:
            self._run()
        except BaseException as e:  # a bug in the loop itself: say so everywhere, never hang
            logger.exception("the engine loop died")
            self.dead = True
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine loop died: {type(e).__name__}"))
        finally:
            self.running = False
            self._fail_inbox()

    def _ranks_lost(self, why: str) -> None:
        """A rank died or the ranks fell out of step: /health says 503 at once and the loop fails
        what is in flight."""
        self.dead = True
        self._wake.set()

    def _run(self) -> None:
        last_progress = time.monotonic()
        while not self._stopping.is_set():
            if self.dead:
                raise EngineDeadError(f"the engine's ranks are lost: {self.engine.ranks.lost}")
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                last_progress = self._moved()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            before = self.engine.num_steps_with_work
            try:
                outs = self.engine.step()
            except StepFailed as e:  # only the requests of that step fail
                self._fail(e.request_ids, e.__cause__ or e)
                last_progress = self._moved()
                continue
            except Exception as e:  # failed before a batch was known: fail what is running
                self._fail(list(self._streams), e)
                last_progress = self._moved()
                continue
            for out in outs:
                self._deliver(out.request_id, out)
            if outs or self.engine.num_steps_with_work != before:
                last_progress = self._moved()
                continue
            if time.monotonic() - last_progress > self.stall_timeout_s and not self.stalled:
                self.stalled = True
                self.stalls += 1
                logger.error("the engine made no progress for %.0f s with work pending", self.stall_timeout_s)
            self._wake.wait(timeout=0.005)  # nothing could run: wait for the inbox rather than spin
            self._wake.clear()
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._deliver(rid, EngineDeadError("the server is shutting down"))

    def _moved(self) -> float:
        self.stalled = False
        return time.monotonic()

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        logger.error("engine step failed for %d request(s)", len(request_ids), exc_info=error)
        self.step_failures += 1
        for rid in request_ids:
            self.engine.abort_request(rid)
            self._deliver(rid, RequestFailedError(f"engine step failed: {type(error).__name__}"))

    def _fail_inbox(self) -> None:
        """Answer whatever is still queued: the loop is gone."""
        try:
            self._drain_inbox(reject=True)
        except Exception:  # the engine itself may be broken; the futures are what matter
            logger.exception("draining the inbox failed")
