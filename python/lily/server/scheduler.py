"""One worker thread that runs generation jobs in arrival order, and the bridge back to asyncio.

The engine is single-threaded by design (one model, one set of caches), so requests queue here
first-in first-out. The queue is bounded: `submit` refuses work when `max_queue` jobs are already
waiting, and a job cancelled while waiting leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import Any, Callable

log = logging.getLogger("lily.server")

DEFAULT_MAX_QUEUE = 16


class QueueFull(Exception):
    """Raised by `Scheduler.submit` when the waiting queue is at its limit."""


class ShuttingDown(Exception):
    """The server is stopping: raised by `submit`, and the error of every job it cut short."""


class Done:
    """The last event of every job; `error` is set when the job raised."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Job:
    """A unit of work for the engine thread; its events are read on the event loop with `next()`."""

    def __init__(self, work: Callable[["Job"], None], loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[Any] = asyncio.Queue()

    def emit(self, event: Any) -> None:
        """Send an event to the waiting request handler (called from the engine thread)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:
            self.cancelled.set()  # the event loop has shut down: nobody is listening any more

    async def next(self) -> Any:
        """The next event; `Done` comes last."""
        return await self._events.get()

    def is_cancelled(self) -> bool:
        """The cancellation hook handed to the engine."""
        return self.cancelled.is_set()


class Scheduler:
    """A bounded FIFO queue in front of one engine thread."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._condition = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="lily-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """How many jobs wait for the engine."""
        with self._condition:
            return len(self._waiting)

    @property
    def stopping(self) -> bool:
        """Whether `shutdown` was called."""
        with self._condition:
            return self._stopping

    @property
    def busy(self) -> bool:
        """Whether a job is running or waiting."""
        with self._condition:
            return self._running is not None or bool(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise `QueueFull` (or `ShuttingDown`)."""
        with self._condition:
            if self._stopping:
                raise ShuttingDown()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (limit {self.max_queue})")
            self._waiting.append(job)
            self._condition.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job: drop it from the queue, or flag it so the engine stops at its next check."""
        job.cancelled.set()
        with self._condition:
            if job in self._waiting:
                self._waiting.remove(job)
                job.emit(Done())

    def shutdown(self) -> None:
        """Cancel everything without waiting: every job ends with `Done(ShuttingDown())`, and the
        worker thread ends after the running job stops."""
        with self._condition:
            self._stopping = True
            for job in self._waiting:
                job.cancelled.set()
                job.emit(Done(ShuttingDown()))
            self._waiting.clear()
            if self._running is not None:
                self._running.cancelled.set()
            self._condition.notify()

    def stop(self) -> None:
        """`shutdown`, then wait for the worker thread to end."""
        self.shutdown()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._waiting and not self._stopping:
                    self._condition.wait()
                if self._stopping:
                    return
                job = self._running = self._waiting.popleft()
            error = None
            try:
                job.work(job)
            except Exception as exc:  # noqa: BLE001 - one failed request must not stop the engine thread
                if not job.is_cancelled():
                    log.exception("generation failed")
                    error = exc
            finally:
                with self._condition:
                    self._running = None
                    if self._stopping and error is None and job.is_cancelled():
                        error = ShuttingDown()
                job.emit(Done(error))
