"""Prometheus metrics of a mount or a storage node: every metric bmfs exports, and the
endpoint that serves them (``--metrics ADDR``; docs/operations.md lists them).

Caveats first: the endpoint has no authentication. It binds the loopback address
unless an address is given; one that other machines reach is logged as a warning.
Counters and histograms are counted where the work is done (fuse/ops.py,
data/client.py, kv/etcd.py, node/server.py; the per-request ones only in a process
that serves them: ``ON``); state (repair backlog, write-behind
queue, devices) is read when scraped, from *sources* the daemon registers
(``add_source``): functions returning ``(gauge name, label values, value)`` rows.
Nothing here imports the rest of bmfs: it is a leaf, usable from every layer.
"""
from __future__ import annotations

import ipaddress
import logging
import threading

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, Counter, Histogram)
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
# whether this process serves metrics (start): the hot paths (a FUSE request, a stripe
# read, a node request) count only then, as counting costs microseconds each
ON = False
for _c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
    REGISTRY.register(_c)

# latency buckets (seconds): from a cached getattr to a stalled device
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
            0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# -- a mount: FUSE requests ---------------------------------------------------------------
FUSE_OPS = Counter("bmfs_fuse_operations", "FUSE requests answered, by operation",
                   ["op"], registry=REGISTRY)
FUSE_ERRORS = Counter("bmfs_fuse_errors", "FUSE requests answered with an error, by "
                      "operation and errno name", ["op", "errno"], registry=REGISTRY)
FUSE_SECONDS = Histogram("bmfs_fuse_operation_seconds", "time to answer a FUSE request, "
                         "by operation", ["op"], buckets=_BUCKETS, registry=REGISTRY)
FUSE_BYTES = Counter("bmfs_fuse_bytes", "bytes read and written through the mount",
                     ["kind"], registry=REGISTRY)

# -- a mount: stripes (data/client.py) ----------------------------------------------------
STRIPE_OPS = Counter("bmfs_stripe_operations", "stripes written, read (a range of one) "
                     "and deleted", ["op"], registry=REGISTRY)
STRIPE_BYTES = Counter("bmfs_stripe_bytes", "bytes of file data stored to and read from "
                       "stripes", ["kind"], registry=REGISTRY)
STRIPE_SECONDS = Histogram("bmfs_stripe_operation_seconds", "time to store a stripe or "
                           "read a range of one", ["op"], buckets=_BUCKETS,
                           registry=REGISTRY)
READS = Counter("bmfs_reads", "stripe reads that were not plain: degraded (decoded from "
                "other fragments) or hedged (a slow device raced by another)", ["kind"],
                registry=REGISTRY)
DAMAGE = Counter("bmfs_fragments_damaged", "fragments reads found missing or corrupt "
                 "(queued for repair)", ["kind"], registry=REGISTRY)

# -- a mount: etcd (kv/etcd.py) -----------------------------------------------------------
ETCD_REQUESTS = Counter("bmfs_etcd_requests", "requests sent to etcd (round trips), by "
                        "API path", ["path"], registry=REGISTRY)
ETCD_FAILURES = Counter("bmfs_etcd_request_failures", "etcd requests that got no usable "
                        "answer (retried on another endpoint or failed)", ["path"],
                        registry=REGISTRY)
ETCD_SECONDS = Histogram("bmfs_etcd_request_seconds", "etcd round-trip time", ["path"],
                         buckets=_BUCKETS, registry=REGISTRY)

# -- a storage node (node/server.py) ------------------------------------------------------
NODE_REQUESTS = Counter("bmfs_node_requests", "requests a storage node served in Python, "
                        "by operation", ["op"], registry=REGISTRY)
NODE_ERRORS = Counter("bmfs_node_request_errors", "requests a storage node answered with "
                      "an error, by operation", ["op"], registry=REGISTRY)
NODE_BYTES = Counter("bmfs_node_bytes", "fragment bytes a storage node wrote and sent",
                     ["kind"], registry=REGISTRY)
NODE_SECONDS = Histogram("bmfs_node_request_seconds", "time a storage node took to "
                         "serve a request, by operation", ["op"], buckets=_BUCKETS,
                         registry=REGISTRY)

# -- state read when scraped: name -> (help, label names) ---------------------------------
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "bmfs_repair_backlog_fragments": ("fragments queued for repair (bmfs status: "
                                      "fragments awaiting repair)", ()),
    "bmfs_write_behind_queue": ("metadata changes queued by etcd write-behind, not yet "
                                "committed", ()),
    "bmfs_open_files_dirty": ("open files with written data not yet stored", ()),
    "bmfs_device_healthy": ("1 if the device answers, 0 if not", ("device",)),
    "bmfs_device_bytes_total": ("size of the device's filesystem", ("device",)),
    "bmfs_device_bytes_free": ("bytes free on the device's filesystem", ("device",)),
    "bmfs_device_used_ratio": ("fullness of the device: 1 - free/total", ("device",)),
    "bmfs_node_native_reads": ("READ requests the node's C path served (counted "
                               "apart from bmfs_node_requests_total)", ()),
    "bmfs_node_connections": ("connections a storage node accepted, all time", ()),
}

_sources: list = []
_sources_lock = threading.Lock()


def add_source(fn) -> None:
    """Read ``fn()`` at every scrape: rows ``(name, label values, value)`` of GAUGES.
    It runs in the endpoint's thread: it must only read (no awaiting, no locks the
    event loop holds)."""
    with _sources_lock:
        _sources.append(fn)


def clear_sources() -> None:
    with _sources_lock:
        _sources.clear()


class _Sampled:
    """The collector of GAUGES: asks every source at scrape time."""

    def collect(self):
        fams = {name: GaugeMetricFamily(name, help_, labels=list(labels))
                for name, (help_, labels) in GAUGES.items()}
        with _sources_lock:
            sources = list(_sources)
        for fn in sources:
            try:
                rows = list(fn())
            except Exception as e:  # a scrape must still answer
                log.warning("metrics: a source failed: %s", e)
                continue
            for name, labels, value in rows:
                fams[name].add_metric([str(v) for v in labels], float(value))
        return [f for f in fams.values() if f.samples]

    def describe(self):
        return []


REGISTRY.register(_Sampled())


def device_rows(dev: int, usage: dict) -> list:
    """The size, free and fullness rows of a device's usage ({total, free})."""
    total, free = usage.get("total", 0), usage.get("free", 0)
    return [("bmfs_device_bytes_total", (dev,), total),
            ("bmfs_device_bytes_free", (dev,), free),
            ("bmfs_device_used_ratio", (dev,), 1 - free / total if total else 0)]


def parse_address(text: str) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT`` as (host, port); the host defaults to
    127.0.0.1.

    Raises:
        ValueError: not one of those, or a port outside 1..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") if host.startswith("[") else host
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--metrics wants PORT or HOST:PORT, not {text!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start(text: str):
    """Serve the metrics at address ``text`` (parse_address) from a thread; returns the
    HTTP server (``shutdown()`` stops it).

    Raises:
        ValueError: a malformed address.
        OSError: the address cannot be bound (e.g. EADDRINUSE).
    """
    global ON
    from prometheus_client import disable_created_metrics, start_http_server
    host, port = parse_address(text)
    disable_created_metrics()  # (a _created series beside each counter: noise here)
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    ON = True
    if not is_loopback(host):
        log.warning("metrics at %s:%d have no authentication: anyone who reaches that "
                    "address reads them (firewall it, or bind 127.0.0.1)", host, port)
    return server


__all__ = ["REGISTRY", "add_source", "start", "parse_address"]
