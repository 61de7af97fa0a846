"""Blocks freed while device work may still read them, given back once that work is done.

An engine that schedules ahead (vLLM's async scheduling) or replays CUDA graphs frees
a request's blocks while kernels it already launched still read them. If kvcached
gave the blocks back at once, a page left empty would be unmapped under those kernels
(measured on an H200: an illegal address, see tests/gpu/test_async_unmap_gpu.py). So a
free records an event on the device's current stream, the stream the engine launches
on, and the blocks go back to the pool once the event has completed: a waiter thread
sleeps on the event (a blocking-sync event, so it does not spin) and releases them, and
the pool's own calls release whatever has completed. No device-wide sync on the hot path,
and an engine that goes idle still gives its memory back.

Only a free that could unmap a page waits. Reusing a block needs no help from kvcached:
the engine writes a reused block in stream order, after the reads it launched before the
free, as vLLM does without kvcached. So ``KVCacheManager.free`` gives a block back at once
when its page keeps a live block (``BlockPool.free_keeping_pages``: no event, no wake-up)
and queues here only the blocks that would leave their page without one. Those stay
pending in the pool, and a pending block does not keep its page for later frees: its
event covers only the work launched before its own free, not the work on a block freed
since, so such a block waits as well, behind it in this queue, which releases in order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kvcached.log import get_kvcached_logger

logger = get_kvcached_logger()


class _Done:
    """The event of host work: it ran before the call that launched it returned."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


def record_event(device: torch.device) -> Any:
    """An event after the work launched so far on ``device``'s current stream (CUDA and ROCm alike)."""
    if torch.device(device).type == "cpu":
        return _Done
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(device))
    return event


class DeferredFree:
    """A queue of (event, block ids), released in order as their events complete."""

    def __init__(self, device: torch.device, release: Callable[[list[int]], None]) -> None:
        self.device = device
        self._release = release
        self._queue: deque[tuple[Any, list[int]]] = deque()
        self._pending: set[int] = set()
        self._cv = threading.Condition()
        self._waiter: threading.Thread | None = None
        self._closed = False
        self.error: BaseException | None = None  # what stopped the waiter thread, if anything did

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._pending

    def add(self, ids: list[int]) -> None:
        """Hold ``ids`` until the work launched so far on the current stream has run."""
        if not ids:
            return
        with self._cv:
            self._queue.append((record_event(self.device), ids))
            self._pending.update(ids)
            if self._waiter is None and not self._closed:
                self._waiter = threading.Thread(target=self._wait_loop, name="kvcached-deferred-free", daemon=True)
                self._waiter.start()
            self._cv.notify()

    def drain(self) -> int:
        """Release every batch whose event completed (in order); returns how many blocks went back."""
        done = 0
        with self._cv:
            while self._queue and self._queue[0][0].query():
                _, ids = self._queue.popleft()
                self._pending.difference_update(ids)
                self._release(ids)
                done += len(ids)
        return done

    def _wait_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                event = self._queue[0][0]
            try:
                event.synchronize()  # without the lock: the engine keeps freeing meanwhile
                self.drain()
            except Exception as exc:  # a broken device context: the pool's next call or flush reports it
                # Said here too: until then, frees that would empty a page wait for the pool's next call.
                self.error = exc
                logger.warning("kvcached: the deferred-free thread stopped (%r); pending frees now wait for "
                               "the pool's next call", exc)
                return

    def flush(self) -> None:
        """Wait for every recorded event and release everything (not for the hot path)."""
        with self._cv:
            while self._queue:
                event, ids = self._queue.popleft()
                event.synchronize()
                self._pending.difference_update(ids)
                self._release(ids)

    def close(self) -> None:
        """:meth:`flush`, then stop the waiter thread."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
