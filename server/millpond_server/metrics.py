"""Prometheus metrics (``--metrics-port``, on ``--metrics-host``), from ``prometheus-client``.

Optional: ``pip install 'millpond[metrics]'``. Without the package the server
runs as before, and ``--metrics-port`` exits 2 saying what to install.

Nothing here is on the push/sample path of the engine:

* per buffer, numbers the engine counts anyway are read at scrape time
  (:class:`_Collector`: sizes, capacities, inserts, samples, bytes in and
  out, records that left, calls waiting now, the RAM it keeps resident), and
  the disk its file takes (a ``stat``);
* per call, the transports report the method, the transport, the buffer
  named, the outcome (a gRPC status name) and the seconds it took
  (:meth:`Metrics.call`: a histogram observation and, on failure, a counter);
* each wait for a rate limiter is a histogram observation when it ends
  (:meth:`Metrics.wait`);
* recovery progress, the fast path's sessions and shared memory, and the gRPC
  edge's open calls and bytes in flight are read at scrape time from the
  registry, the listener and the gate; calls the gate refuses are counted as
  failed calls;
* the process (``process_*``: memory, CPU, open files and their limit) and
  Python (``python_info``) from prometheus-client's own collectors, and the
  daemon's version (``millpond_build_info``).

The ``buffer`` label of a call names a buffer the daemon holds (served or
held out of service), else it is empty: a call naming no buffer (List,
Negotiate), or a name no buffer has (a typo, a hostile client's made-up
names), adds no series. Series of buffers deleted since are dropped at the
next scrape, so their number follows the buffers held (``--max-buffers``).
"""

from __future__ import annotations

import logging
import platform
import threading
from typing import TYPE_CHECKING, Any, Iterator

from millpond.core import TieredBuffer

from .config import ServeConfig
from .operations import Operations
from .registry import Registry

if TYPE_CHECKING:
    from .edge import Gate
    from .shm_listener import FastPathServer

log = logging.getLogger("millpond.metrics")
# Seconds: from a same-host fast-path call (~50 us) to a long rate-limiter wait.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Fast-path ops as the RPC they stand for (one label set for both transports).
SHM_METHODS = {"push": "PushBatch", "sample": "Sample", "update_priorities": "UpdatePriorities",
               "set_beta": "SetBeta", "hello": "ShmHello", "push_segment": "ShmPushSegment",
               "result_segment": "ShmResultSegment", "release": "ShmRelease"}


def start_metrics(cfg: ServeConfig, registry: Registry, ops: Operations,
                  fastpath: "FastPathServer | None") -> "Metrics | None":
    """With ``--metrics-port``: the metrics, fed by ``ops`` and served on
    ``--metrics-host`` (default ``--host``) from now on (``metrics on HOST:PORT`` is
    printed); None without it."""
    if cfg.metrics_port is None:
        return None
    metrics = Metrics(registry, ops)
    metrics.fastpath = fastpath
    bind = cfg.host if cfg.metrics_host is None else cfg.metrics_host
    host = bind if ":" not in bind or bind.startswith("[") else f"[{bind}]"
    try:
        port = metrics.serve(bind, cfg.metrics_port)
    except OSError as exc:  # exit 1 with this message
        raise OSError(f"cannot bind the metrics port {host}:{cfg.metrics_port}: {exc}") from None
    ops.observer = metrics
    log.info("metrics", extra={"kv": {"address": f"{host}:{port}"}})
    print(f"metrics on {host}:{port}", flush=True)
    return metrics


class Metrics:
    """The daemon's metrics, in a registry of their own; see the module docstring."""

    def __init__(self, registry: Registry, ops: Operations):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Histogram,
            Info,
            PlatformCollector,
            ProcessCollector,
        )

        import millpond

        self.registry = registry
        self.ops = ops
        self.fastpath: FastPathServer | None = None
        self.gate: Gate | None = None
        self.prometheus = CollectorRegistry(auto_describe=True)
        self._labels: set[str] = set()  # buffer names in per-buffer series
        self._labels_lock = threading.Lock()
        self.prometheus.register(_ForgetGone(self))  # first: before the series are read
        # process_*: resident and virtual memory, CPU seconds, open files and their limit,
        # start time (from /proc; nothing where there is none); python_info.
        ProcessCollector(registry=self.prometheus)
        PlatformCollector(registry=self.prometheus)
        Info("millpond_build", "The daemon's version, and the Python running it",
             registry=self.prometheus).info({"version": millpond.__version__,
                                             "python": platform.python_version()})
        self.latency = Histogram(
            "millpond_rpc_duration_seconds", "Calls by method, transport and buffer (empty: "
            "none, or one the daemon does not hold), and how long they took (waits for rate "
            "limiters included)", ["method", "transport", "buffer"],
            buckets=LATENCY_BUCKETS, registry=self.prometheus)
        self.errors = Counter(
            "millpond_rpc_errors", "Failed calls by method, transport and gRPC status code",
            ["method", "transport", "code"], registry=self.prometheus)
        self.waits = Histogram(
            "millpond_rate_limiter_wait_seconds", "Waits of pushes (kind=insert) and samples "
            "for a buffer's rate limiter", ["buffer", "kind"], buckets=LATENCY_BUCKETS,
            registry=self.prometheus)
        self.prometheus.register(_Collector(self))
        self._server: Any = None

    # ---- what the transports and the operations layer report ------------------------------

    def call(self, transport: str, method: str, code: str, seconds: float,
             buffer: str | None = None) -> None:
        """One call ended (``code``: "OK" or the gRPC status name of its error); ``buffer``:
        the name it gave, if any (labelled only if the daemon holds such a buffer)."""
        if transport == "shm":
            method = SHM_METHODS.get(method, "ShmUnknown")
        label = buffer if buffer and self.registry.holds(buffer) else ""
        if label:
            self._labelled(label)
        self.latency.labels(method, transport, label).observe(seconds)
        if code != "OK":
            self.errors.labels(method, transport, code).inc()

    def refused(self, method: str, code: str) -> None:
        """The gRPC edge ended a call before it was served (:class:`.edge.Gate`)."""
        self.errors.labels(method, "grpc", code).inc()

    def _labelled(self, name: str) -> None:
        """Note that series are labelled with buffer ``name`` (see :meth:`forget_gone`)."""
        if name not in self._labels:
            with self._labels_lock:
                self._labels.add(name)

    def forget_gone(self) -> None:
        """Drop the per-buffer series of buffers the daemon no longer holds (deleted). A
        buffer made again under such a name starts its series anew."""
        with self._labels_lock:
            gone_names = {name for name in self._labels if not self.registry.holds(name)}
            self._labels -= gone_names
        if not gone_names:
            return
        for metric, labels in ((self.latency, ("method", "transport", "buffer")),
                               (self.waits, ("buffer", "kind"))):
            gone = {tuple(sample.labels[label] for label in labels)
                    for family in metric.collect() for sample in family.samples
                    if sample.labels.get("buffer") in gone_names}
            for values in gone:
                metric.remove(*values)

    def wait(self, buffer: TieredBuffer, kind: str, seconds: float) -> None:
        """A call waited ``seconds`` for ``buffer``'s rate limiter (it may still fail)."""
        name = next((n for n, b in self.registry.list() if b is buffer), None)
        if name is not None:
            self._labelled(name)
            self.waits.labels(name, kind).observe(seconds)

    # ---- serving ---------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` (a thread); return the port."""
        from prometheus_client import start_http_server

        self._server, _ = start_http_server(port, host.strip("[]") or "0.0.0.0",
                                            registry=self.prometheus)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ForgetGone:
    """Collected first at each scrape: drops the series of buffers deleted since the last
    (:meth:`Metrics.forget_gone`), so they are not in this scrape. Yields nothing."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        self.metrics.forget_gone()
        return iter(())


class _Collector:
    """Numbers read at scrape time: buffers, recovery, the fast path."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list:
        return []  # unchecked: the families depend on what the daemon holds

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def family(kind: Any, name: str, text: str, labels: tuple[str, ...] = ("buffer",)) -> Any:
            return kind(name, text, labels=list(labels))

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        size = family(gauge, "millpond_buffer_size", "Records that can be sampled")
        records = family(gauge, "millpond_buffer_records", "Live records by tier",
                         ("buffer", "tier"))
        capacity = family(gauge, "millpond_buffer_capacity", "Capacity in records by tier "
                          "(hot: RAM; total: hot + cold)", ("buffer", "tier"))
        inserts = family(counter, "millpond_buffer_inserts", "Records pushed since the buffer "
                         "was created or recovered")
        samples = family(counter, "millpond_buffer_samples", "Records sampled since the buffer "
                         "was created or recovered")
        bytes_in = family(counter, "millpond_buffer_bytes_in", "Record bytes pushed (inserts x "
                          "record size)")
        bytes_out = family(counter, "millpond_buffer_bytes_out", "Record bytes sampled (samples "
                           "x record size)")
        evicted = family(counter, "millpond_buffer_evicted_records", "Records that left the "
                         "buffer: evicted, or taken by a queue or stack (since creation)")
        waiting = family(gauge, "millpond_buffer_waiting_calls", "Calls waiting for the rate "
                         "limiter now", ("buffer", "kind"))
        damaged = family(gauge, "millpond_buffer_damaged", "1 for each buffer held out of "
                         "service since start-up, by state (damaged, unreadable, "
                         "unknown-format): repair or delete it", ("buffer", "state"))
        left_out = family(gauge, "millpond_buffer_damaged_records", "Live records of a served "
                          "buffer left out as damaged at recovery (--recover skip-corrupt "
                          "without room to rewrite it)")
        memory = family(gauge, "millpond_buffer_memory_bytes", "RAM the buffer keeps resident: "
                        "its hot tier, sum trees, per-slot arrays not in its file")
        disk = family(gauge, "millpond_buffer_disk_bytes", "Disk its file takes (blocks "
                      "allocated; buffers held out of service too)")
        registry = self.metrics.registry
        for name, buffer in registry.list():
            try:
                info = self.metrics.ops.info(name, buffer)  # with the waits its owner parked
            except Exception:  # closed while we looked: gone from the next scrape
                continue
            nbytes = info.record_nbytes
            size.add_metric([name], info.size)
            records.add_metric([name, "hot"], info.hot_size)
            records.add_metric([name, "cold"], info.cold_size)
            capacity.add_metric([name, "hot"], info.hot_capacity)
            capacity.add_metric([name, "total"], info.total_capacity)
            inserts.add_metric([name], info.inserts)
            samples.add_metric([name], info.samples)
            bytes_in.add_metric([name], info.inserts * nbytes)
            bytes_out.add_metric([name], info.samples * nbytes)
            evicted.add_metric([name], info.pushed - info.hot_size - info.cold_size)
            waiting.add_metric([name, "insert"], info.waiting_inserts)
            waiting.add_metric([name, "sample"], info.waiting_samples)
            left_out.add_metric([name], info.damaged)
            memory.add_metric([name], info.memory_needed)
            disk.add_metric([name], registry.disk_bytes(name))
        held = registry.held_list()
        for entry in held:
            damaged.add_metric([entry.name, entry.state], 1)
            disk.add_metric([entry.name], registry.disk_bytes(entry.name))
        yield from (size, records, capacity, inserts, samples, bytes_in, bytes_out, evicted,
                    waiting, damaged, left_out, memory, disk)
        yield from self._recovery(gauge)
        yield from self._fastpath(gauge)
        yield from self._edge(gauge)

    def _edge(self, gauge: Any) -> Iterator[Any]:
        gate = self.metrics.gate
        if gate is None:
            return
        yield gauge("millpond_grpc_calls_open", "gRPC calls and streams being served",
                    value=gate.calls.sum)
        yield gauge("millpond_grpc_inflight_bytes", "Request bytes the daemon holds now",
                    value=gate.inflight.sum)
        yield gauge("millpond_grpc_client_hosts", "Client hosts with calls being served",
                    value=len(gate.calls.held))

    def _recovery(self, gauge: Any) -> Iterator[Any]:
        registry, ops = self.metrics.registry, self.metrics.ops
        done, total, checked, live = registry.recovery
        yield gauge("millpond_ready", "1 once the buffers are recovered and calls are served",
                    value=1 if ops.ready else 0)
        yield gauge("millpond_recovery_buffers", "Buffer files found at start-up",
                    value=total)
        yield gauge("millpond_recovery_buffers_done", "Buffer files recovered so far", value=done)
        yield gauge("millpond_recovery_records_checked", "Records of the buffer being "
                    "recovered checked so far", value=checked)
        yield gauge("millpond_recovery_records", "Live records of the buffer being recovered",
                    value=live)
        yield gauge("millpond_buffers", "Buffers the daemon holds", value=len(registry))

    def _fastpath(self, gauge: Any) -> Iterator[Any]:
        fastpath = self.metrics.fastpath
        clients, sessions, held = fastpath.usage() if fastpath is not None else (0, 0, 0)
        yield gauge("millpond_shm_clients", "Client processes on the shared-memory fast path",
                    value=clients)
        yield gauge("millpond_shm_sessions", "Fast-path sessions open", value=sessions)
        yield gauge("millpond_shm_bytes", "Shared memory the fast-path sessions hold, bytes",
                    value=held)
