"""Prometheus metrics of kvcached instances, read from their ``/dev/shm`` segments.

Needs the optional ``prometheus_client`` (``pip install prometheus-client`` or
``kvcached[metrics]``). Served by ``kvctl serve-metrics --port N`` for every instance on
the host, and, under vLLM with kvcached enabled, on the engine's own ``/metrics`` for
that engine's instance. One sample per instance (label ``name``, the segment's name):

- ``kvcached_mapped_bytes``: physical KV memory mapped (in use + preallocated)
- ``kvcached_in_use_bytes``: memory of pages holding blocks
- ``kvcached_limit_bytes``: the limit in force (the capacity when none is set)
- ``kvcached_peak_bytes``: most in use at once since the engine started or ``kvctl peak --reset``
- ``kvcached_capacity_bytes``: every page the pools can address
- ``kvcached_pages_mapped_total`` / ``kvcached_pages_unmapped_total``: page-group maps and unmaps so far
- ``kvcached_limit_revision``: the limit's revision (kvcached.control; -1 none)
- ``kvcached_up``: 1 while the owning process lives, 0 for a segment left by a dead one
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from kvcached import config, mem_info
from kvcached.errors import KVCachedConfigError
from kvcached.log import get_kvcached_logger

logger = get_kvcached_logger()

_GAUGES = (
    ("mapped_bytes", "Physical KV memory mapped (in use + preallocated), bytes.",
     lambda i: i.used_size + i.prealloc_size),
    ("in_use_bytes", "KV memory of pages holding blocks, bytes.", lambda i: i.used_size),
    ("limit_bytes", "KV memory limit in force (the capacity when none is set), bytes.", lambda i: i.total_size),
    ("peak_bytes", "Most KV memory in use at once since the start or the last peak reset, bytes.",
     lambda i: i.peak_used),
    ("capacity_bytes", "KV memory every page of the pools would take, bytes.", lambda i: i.capacity),
    ("limit_revision", "Revision of the limit (kvcached.control); -1: none.", lambda i: i.limit_revision),
    ("up", "1 while the instance's process lives.", lambda i: int(mem_info.pid_alive(i.pid))),
)
_COUNTERS = (
    ("pages_mapped", "Page groups mapped since the instance started.", lambda i: i.pages_mapped),
    ("pages_unmapped", "Page groups unmapped since the instance started.", lambda i: i.pages_unmapped),
)


def require_prometheus_client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise KVCachedConfigError(
            "kvcached's Prometheus metrics need the prometheus_client package: pip install prometheus-client "
            "(or pip install 'kvcached[metrics]')."
        ) from None
    return prometheus_client


class SegmentCollector:
    """A prometheus_client collector: each scrape reads the segments (all, or ``names``, or those whose
    name starts with ``prefix``). A segment that cannot be read is left out, never fails the scrape."""

    def __init__(self, names: list[str] | None = None, prefix: str | None = None) -> None:
        self.names = [mem_info.check_name(n) for n in names] if names else None
        self.prefix = prefix

    def _infos(self) -> list[mem_info.MemInfo]:
        p = self.prefix
        names = self.names or [n for n in mem_info.list_segments() if not p or n == p or n.startswith(p + "_")]
        out = []
        for name in names:
            try:
                out.append(mem_info.read_segment(name))
            except (OSError, ValueError, TimeoutError) as exc:
                logger.debug("kvcached metrics: %s left out: %s", name, exc)
        return out

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        infos = self._infos()
        for key, doc, value in _GAUGES:
            family = GaugeMetricFamily(f"kvcached_{key}", doc, labels=["name"])
            for i in infos:
                family.add_metric([i.name], value(i))
            yield family
        for key, doc, value in _COUNTERS:
            family = CounterMetricFamily(f"kvcached_{key}", doc, labels=["name"])
            for i in infos:
                family.add_metric([i.name], value(i))
            yield family


def serve(port: int, host: str = "127.0.0.1", names: list[str] | None = None) -> Any:
    """Serve ``/metrics`` on ``host:port`` from a thread (port 0: any free port); returns the HTTP server
    (``server.server_port``; ``server.shutdown()`` stops it)."""
    prom = require_prometheus_client()
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}.")
    registry = prom.CollectorRegistry()
    registry.register(SegmentCollector(names))
    server, _ = prom.start_http_server(port, addr=host, registry=registry)
    return server


_engine_registered = False


def register_engine_collector() -> bool:
    """Add this engine's instance to prometheus_client's default registry, which vLLM serves on its
    ``/metrics``; False (nothing done) without prometheus_client. Once per process."""
    global _engine_registered
    if _engine_registered:
        return True
    try:
        prom = require_prometheus_client()
    except KVCachedConfigError:
        return False
    explicit = config.ipc_name_override()
    # the API server is not the process that owns the segment, but it shares its process group
    prefix = None if explicit else f"{mem_info.SHM_PREFIX}vLLM_{os.getpgid(0)}"
    prom.REGISTRY.register(SegmentCollector([explicit] if explicit else None, prefix))
    _engine_registered = True
    return True
