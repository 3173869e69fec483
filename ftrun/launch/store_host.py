"""Where a launcher's control store is: the address this node's listening sockets bind, and the store itself,
hosted here or joined (:func:`open_control_store`).

Invariants: in local mode everything binds loopback and the store is hosted here; with etcd the store is joined,
never hosted; with c10d node 0's launcher (or, without node ranks yet, every launcher on the endpoint's host)
tries to host it and joins the store already serving the endpoint when the port is taken.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil
from torch.distributed import TCPStore

from ftrun.control.backend import OutageReport, StoreAddress, open_store
from ftrun.control.spec import split_endpoint
from ftrun.control.store import LOOPBACK, C10dStore, Store, check_bind_address, host_store, route_address
from ftrun.errors import UsageError
from ftrun.events import EventLog
from ftrun.launch.config import JobConfig


@dataclass
class OpenedStore:
    """The control store as :func:`open_control_store` opened it: its host and port (with etcd, the first
    member's), a client, where it is, and the server when this launcher hosts it (c10d), else None."""

    host: str
    port: int
    client: Store
    address: StoreAddress
    server: TCPStore | None = None


def is_local_host(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise UsageError(f"--rdzv-endpoint host {host!r} does not resolve") from None
    local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(ipaddress.ip_address(a).is_loopback or a in local for a in addresses)


def bind_address(cfg: JobConfig) -> str:
    """The address this node's listening sockets bind: loopback in local mode, else ``--rdzv-bind`` (checked),
    ``--local-addr`` (an address of this host), or the address of the interface that reaches the control
    store's host."""
    if cfg.local_mode:
        return LOOPBACK
    if cfg.rdzv_bind is not None:
        return check_bind_address(cfg.rdzv_bind)
    if cfg.local_addr is not None:
        return check_bind_address(cfg.local_addr, "--local-addr")
    assert cfg.rdzv_endpoint is not None
    return route_address(*split_endpoint(cfg.rdzv_endpoint.split(",")[0]))


def open_control_store(cfg: JobConfig, bind: str, events: EventLog) -> OpenedStore:
    """Host or join the control store (``bind``: :func:`bind_address`)."""
    report = OutageReport(lambda message: events.emit("store_outage", message))
    if cfg.rdzv_backend == "etcd":
        assert cfg.rdzv_endpoint is not None
        address = StoreAddress("etcd", cfg.rdzv_endpoint, cfg.store_conf)
        host, port = split_endpoint(cfg.rdzv_endpoint.split(",")[0])
        return OpenedStore(host, port, open_store(address, cfg.rdzv_timeout, report), address)
    if cfg.local_mode:
        host, port = split_endpoint(cfg.rdzv_endpoint, any_port=True) if cfg.rdzv_endpoint else (LOOPBACK, 0)
        if cfg.rdzv_endpoint and not is_local_host(host):
            raise UsageError(f"--rdzv-endpoint {cfg.rdzv_endpoint} is not on this host, but a job of this host "
                             "alone hosts its control store here: give 127.0.0.1:PORT, or --node-rank N for a "
                             "node of a multi-node job")
        server = host_store(port, bind=LOOPBACK, flag=cfg.endpoint_flag)
        return OpenedStore(LOOPBACK, server.port, C10dStore(server),
                           StoreAddress("c10d", f"{LOOPBACK}:{server.port}"), server)
    assert cfg.rdzv_endpoint is not None
    host, port = split_endpoint(cfg.rdzv_endpoint)
    address = StoreAddress("c10d", cfg.rdzv_endpoint)
    # node 0 hosts it; without node ranks yet (rank_by_store) every launcher on the endpoint's host tries to,
    # as torchrun's is_host: the first binds the port, the others (and all when an `ftrun store` serves it) join
    if (cfg.node_rank == 0 or cfg.rank_by_store) and is_local_host(host):
        try:
            server = host_store(port, bind=bind, flag=cfg.endpoint_flag)
            return OpenedStore(host, port, C10dStore(server), address, server)
        except UsageError:
            pass  # an `ftrun store` may already serve this endpoint: join it, or say it is not a store
    return OpenedStore(host, port, open_store(address, cfg.rdzv_timeout, report,
                                              waiting=lambda message: events.emit("store_wait", message)), address)


def store_hint(cfg: JobConfig) -> str:
    """What to use instead of a control store that went away with a node (nothing in local mode, or with etcd)."""
    if cfg.rdzv_backend == "c10d" and not cfg.local_mode:
        return "; a store that outlives any node: --rdzv-backend etcd, or `ftrun store` on a host of its own"
    return ""
