"""Opening a job's control store from its settings: the c10d ``TCPStore`` at ``host:port`` (the default), or an
etcd v3 cluster (``--rdzv-backend etcd --rdzv-endpoint h1:2379,h2:2379,h3:2379``: no single point of failure).

Both give a :class:`~ftrun.control.store.Store`; everything above this module is the same for both. An etcd
store that loses its quorum pauses its caller instead of failing; :class:`OutageReport` turns the pauses of the
several connections of one process (supervisor, beat thread, keeper link) into one line when the control store
goes away and one when it is back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed import DistError

from ftrun.control.spec import NodeSpec
from ftrun.control.store import STORE_OP_TIMEOUT, C10dStore, Store, connect_store
from ftrun.errors import UsageError


@dataclass(frozen=True)
class StoreAddress:
    """Where a job's control store is: ``backend`` "c10d" (``endpoint`` host:port) or "etcd" (``endpoint`` a
    comma-separated list of members' host:port; ``conf``: TLS and authentication settings of ``--rdzv-conf``)."""

    backend: str
    endpoint: str
    conf: dict[str, str] = field(default_factory=dict)


class OutageReport:
    """One line when the first of this process's store connections stalls, one when the last recovers."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._lock = threading.Lock()
        self._stalled = 0
        self._since = 0.0

    def outage(self, message: str) -> None:
        with self._lock:
            self._stalled += 1
            if self._stalled == 1:
                self._since = time.monotonic()
                self._say(f"control store unavailable, pausing: {message}")

    def failed(self) -> None:
        """A stalled operation ended without an answer: no longer stalled, and nothing said (its caller reports
        the store lost)."""
        with self._lock:
            self._stalled = max(0, self._stalled - 1)

    def recovered(self, seconds: float) -> None:
        with self._lock:
            self._stalled = max(0, self._stalled - 1)
            if self._stalled == 0:
                self._say(f"control store back after {time.monotonic() - self._since:.1f}s; going on")


def open_store(address: StoreAddress, timeout: float, report: OutageReport | None = None,
               waiting: Callable[[str], None] | None = None) -> Store:
    """A client of the control store at ``address``, waiting up to ``timeout`` seconds for it to answer (a
    :class:`~ftrun.errors.UsageError` names the endpoint otherwise; a c10d store's ``waiting`` is told once
    when that takes a while)."""
    if address.backend == "etcd":
        from ftrun.control.etcd import connect_etcd  # only etcd users import its HTTP client

        return connect_etcd(address.endpoint, timeout, address.conf,
                            on_outage=report.outage if report else None,
                            on_recovered=report.recovered if report else None)
    host, _, port = address.endpoint.rpartition(":")
    return C10dStore(connect_store(host.strip("[]"), int(port), timeout, waiting),
                     on_outage=report.outage if report else None, on_recovered=report.recovered if report else None,
                     on_failed=report.failed if report else None)


def reconnect_timeout(address: StoreAddress, rdzv_timeout: float) -> float:
    """How long a process that reached the control store already waits for another connection to it: a c10d store
    that does not answer now is gone or silent, as for any operation (60 s), not one still starting
    (``--rdzv-timeout``); etcd's timeout is how long the job pauses without quorum, ``--rdzv-timeout``."""
    if address.backend == "etcd":
        return rdzv_timeout
    return min(rdzv_timeout, STORE_OP_TIMEOUT.total_seconds())


def reopen_store(address: StoreAddress, rdzv_timeout: float, report: OutageReport | None = None) -> Store:
    """Another connection to the control store, for a process that reached it already: waits
    :func:`reconnect_timeout`, and a store not reached by then is lost, ``DistError`` as for an operation."""
    try:
        return open_store(address, reconnect_timeout(address, rdzv_timeout), report)
    except UsageError as err:
        raise DistError(str(err)) from None


def spec_address(spec: NodeSpec) -> StoreAddress:
    """Where the control store of the job ``spec`` belongs to is."""
    if spec.rdzv_backend == "etcd":
        return StoreAddress("etcd", spec.rdzv_endpoint, dict(spec.rdzv_conf))
    return StoreAddress("c10d", f"{spec.store_host}:{spec.store_port}")
