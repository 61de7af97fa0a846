"""Blocks freed while device work may still read them, given back once that work is done.

An engine that schedules ahead (vLLM's async scheduling) or replays CUDA graphs frees
a request's blocks while kernels it already launched still read them. If kvcached
gave the blocks back at once, a page left empty would be unmapped under those kernels
(a read of the zero page, or an illegal address between unmap and remap). So a free
records an event on the device's current stream, the stream the engine launches on,
and the blocks go back to the pool only when the event has completed: polled with
``Event.query`` on the next pool call, never a device-wide sync on the hot path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch


def record_event(device: torch.device) -> Any:
    """An event after the work launched so far on ``device``'s current stream (CUDA and ROCm alike)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class DeferredFree:
    """A queue of (event, block ids); :meth:`drain` releases those whose event completed."""

    def __init__(self, device: torch.device, release: Callable[[list[int]], None]) -> None:
        self.device = device
        self._release = release
        self._queue: deque[tuple[Any, list[int]]] = deque()
        self._pending: set[int] = set()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._pending

    def add(self, ids: list[int]) -> None:
        """Hold ``ids`` until the work launched so far on the current stream has run."""
        if not ids:
            return
        self._queue.append((record_event(self.device), ids))
        self._pending.update(ids)

    def drain(self) -> int:
        """Release every batch whose event completed (in order); returns how many blocks went back."""
        done = 0
        while self._queue and self._queue[0][0].query():
            _, ids = self._queue.popleft()
            self._pending.difference_update(ids)
            self._release(ids)
            done += len(ids)
        return done

    def flush(self) -> None:
        """Wait for every recorded event, then release everything (shutdown, not the hot path)."""
        while self._queue:
            event, ids = self._queue.popleft()
            event.synchronize()
            self._pending.difference_update(ids)
            self._release(ids)
