"""How much background transfers delay trainers, by the transfers' CPU priority: nice 10, nice 19, ``SCHED_IDLE``.

Three "trainer" processes each compute ``--compute-ms`` (matrix products in torch, one thread) and then sleep
``--sleep-ms`` (a GPU step leaves the host's cores idle), for ``--seconds``. Beside them, three loopback TCP
streams, as keepers fetch parity data: a client asks for 8 MiB at a time and the server sends it from a file in
/dev/shm (``sendfile``), received with ``recv_into(MSG_WAITALL)``. Both ends of each stream run at the priority
being measured (``SCHED_IDLE`` through :func:`ftrun.snapshot.priority.lower_to_background`, as the keepers do).
Printed: the trainers' wall time of compute over its CPU time (1.00: never kept waiting for a core) and the
streams' throughput, for each priority and with no streams, side by side in one run.

    .venv/bin/python benchmarks/priority.py        # about 30 s
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
from multiprocessing.synchronize import Event

import torch

from ftrun.snapshot.priority import lower_to_background

REQUEST = 8 << 20
FILE_SIZE = 64 << 20


def _lower(mode: str) -> None:
    if mode == "SCHED_IDLE":
        lower_to_background()
    else:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(mode.split()[1]))


def _server(listener: socket.socket, mode: str) -> None:
    _lower(mode)
    with tempfile.TemporaryFile(dir="/dev/shm") as source:
        source.write(b"x" * FILE_SIZE)
        source.flush()
        conn, _ = listener.accept()
        offset = 0
        while conn.recv(1):
            sent = 0
            while sent < REQUEST:
                sent += conn.sendfile(source, offset + sent, REQUEST - sent)
            offset = (offset + REQUEST) % (FILE_SIZE - REQUEST)


def _client(port: int, mode: str, stop: Event, received: mp.Value) -> None:  # type: ignore[type-arg]
    _lower(mode)
    sock = socket.create_connection(("127.0.0.1", port))
    view = memoryview(bytearray(REQUEST))
    while not stop.is_set():
        sock.sendall(b"g")
        got = 0
        while got < REQUEST:
            got += sock.recv_into(view[got:], REQUEST - got, socket.MSG_WAITALL)
        with received.get_lock():
            received.value += REQUEST


def _trainer(args: argparse.Namespace, results: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    a = torch.rand(256, 256)
    products = 1
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.compute_ms / 1000:  # calibrate: products per compute period
        torch.mm(a, a)
        products += 1
    wall = cpu = 0.0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(products):
            torch.mm(a, a)
        wall += time.perf_counter() - t0
        cpu += time.thread_time() - c0
        time.sleep(args.sleep_ms / 1000)
    results.put((wall, cpu))


def measure(mode: str | None, args: argparse.Namespace) -> tuple[float, float]:
    """(trainers' compute wall / CPU time, streams' GB/s) with streams at ``mode`` (None: no streams)."""
    stop, results = mp.Event(), mp.Queue()
    received = mp.Value("q", 0)
    helpers: list[mp.Process] = []
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(3 if mode else 0)]
    for listener in listeners:
        helpers.append(mp.Process(target=_server, args=(listener, mode), daemon=True))
        helpers.append(mp.Process(target=_client, args=(listener.getsockname()[1], mode, stop, received),
                                  daemon=True))
    trainers = [mp.Process(target=_trainer, args=(args, results)) for _ in range(3)]
    try:
        for process in helpers:
            process.start()
        for listener in listeners:
            listener.close()  # the servers' copies accept
        time.sleep(0.3)
        started = time.monotonic()
        for process in trainers:
            process.start()
        done = [results.get(timeout=args.seconds + 60) for _ in trainers]
        seconds = time.monotonic() - started
    finally:
        stop.set()
        for process in trainers + helpers:
            process.kill()
            process.join()
    return sum(w for w, _ in done) / sum(c for _, c in done), received.value / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--sleep-ms", type=float, default=70.0)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    print(f"3 trainers ({args.compute_ms:g} ms compute, {args.sleep_ms:g} ms sleep) beside 3 loopback TCP streams "
          f"of {REQUEST >> 20} MiB requests, {os.cpu_count()} cores")
    for mode in (None, "nice 10", "nice 19", "SCHED_IDLE"):
        slowdown, rate = measure(mode, args)
        print(f"  streams {mode or 'off':10s}: trainers' compute wall / CPU time {slowdown:.2f}, "
              f"streams {rate:.2f} GB/s")


if __name__ == "__main__":
    main()
