"""Hosting of and connections to torch ``TCPStore`` servers, with errors a user can act on.

The control store of a job and each generation's trainer store are plain ``torch.distributed.TCPStore``
servers. Connecting is done in two stages so that failures are bounded and readable: first a plain TCP
probe until the endpoint accepts (unreachable -> :class:`UsageError` after ``timeout``), then the store
handshake in a helper thread with a deadline (a port held by something that is not a store never answers).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

from torch.distributed import DistError, TCPStore

from ftrun.errors import UsageError

# Store operations (get/wait) that outlive this are errors; the job itself only uses non-blocking calls.
STORE_OP_TIMEOUT = timedelta(seconds=60)
_HANDSHAKE_TIMEOUT = 5.0


def host_store(port: int, what: str = "control store", host: str = "127.0.0.1") -> TCPStore:
    """Start a store server on ``port`` (0: any free port); a port in use is a :class:`UsageError`.

    torch's server listens on every interface; ``host`` is where its own client connects.
    """
    try:
        return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=STORE_OP_TIMEOUT)
    except DistError as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            raise UsageError(f"{what} port {port} is already in use (choose another with --rdzv-endpoint)") from None
        raise UsageError(f"cannot start the {what} on port {port}: {str(err).splitlines()[0]}") from None


def wait_until_reachable(host: str, port: int, timeout: float) -> None:
    """Return once ``host:port`` accepts TCP connections; raise :class:`UsageError` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                reason = err.strerror or str(err)
                raise UsageError(f"control store at {host}:{port} is unreachable after {timeout:g}s ({reason})") from None
            time.sleep(0.1)


def connect_store(host: str, port: int, timeout: float) -> TCPStore:
    """A client of the store at ``host:port``, waiting up to ``timeout`` seconds for it to come up."""
    wait_until_reachable(host, port, timeout)
    result: list[TCPStore | BaseException] = []

    def handshake() -> None:
        try:
            result.append(TCPStore(host, port, is_master=False, timeout=STORE_OP_TIMEOUT))
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            result.append(err)

    thread = threading.Thread(target=handshake, name="ftrun-store-connect", daemon=True)
    thread.start()
    thread.join(_HANDSHAKE_TIMEOUT)
    if not result:
        raise UsageError(f"{host}:{port} accepts connections but is not a torch TCPStore (no handshake "
                         f"within {_HANDSHAKE_TIMEOUT:g}s): is the port used by another program?")
    if isinstance(result[0], BaseException):
        raise UsageError(f"cannot connect to the control store at {host}:{port}: {str(result[0]).splitlines()[0]}")
    return result[0]
