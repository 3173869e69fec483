"""The zygote: a fork of its node's supervisor that has imported torch and forks ready trainers in milliseconds.

Starting a trainer the usual way costs a new interpreter and ``import torch`` (2-3 s here, 8 s for four at
once); a fork of a process that already imported torch is ready in about 6 ms. The supervisor imports torch
anyway, so the zygote is a plain fork of it, made before the supervisor starts any thread or connection
(:class:`ZygoteClient`): it costs no interpreter and no import of its own. The zygote never runs a torch
operation (a fork after a multi-threaded torch op hangs the child) and never initialises CUDA.

What training scripts import next (:data:`PRELOAD`: DDP and the optimizers import ``torch._dynamo``, 1.8 s
here) is not on the way to the first trainers: the supervisor asks for it (:meth:`ZygoteClient.preload`) once its
trainers have all beaten (they are past their first step, which imports it too), else 5 s into the first
generation (not on the way to a restart before the first step either, a crash loop's: the zygote forks nothing
while it imports), so that later generations start with it imported; a spare's zygote at once. It imports
in a thread of the lowest CPU priority (``SCHED_IDLE``, :mod:`ftrun.snapshot.priority`), so that the trainers
running meanwhile keep their cores; the trainers it forks later have the priority of its main thread.

Protocol on the socket pair, one JSON document per line:

- supervisor -> zygote: a :class:`SpawnRequest`; zygote -> supervisor: ``{"pid": N}`` or ``{"error": "..."}``.
  A request with ``stdio`` is answered ``{"send_fds": N}`` first; the supervisor then sends one byte carrying
  the N descriptors (SCM_RIGHTS), which the trainer gets as its stdout/stderr.
- supervisor -> zygote: ``{"preload": true}`` (no answer): import :data:`PRELOAD` now.

Each trainer is forked twice (zygote -> intermediate -> trainer) and the intermediate exits at once, so the
trainer is re-parented to the supervisor, a child subreaper: the supervisor then waits for it like any child
and sees its exit status within one poll. The trainer leads its own session, and arms PR_SET_PDEATHSIG only
once it is the supervisor's child, so it dies with the supervisor.
"""
from __future__ import annotations

import importlib
import json
import os
import socket
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import NoReturn

from ftrun.control.spec import FORWARDED_SIGNALS
from ftrun.launch.bootstrap import run_main
from ftrun.launch.processes import ZYGOTE_NAME, die_with_parent, set_process_name
from ftrun.snapshot.priority import lower_priority

# imported by the supervisor before the fork: torch, torch.distributed. Asked for later (see the docstring):
# torch._dynamo, which DistributedDataParallel and the optimizers' first step import (1-4 s per trainer).
PRELOAD = ("torch.nn.parallel", "torch._dynamo", "numpy")
SPAWN_TIMEOUT = 60.0  # seconds for one fork, a preload under way included
_REPARENT_TIMEOUT = 5.0


@dataclass(frozen=True)
class SpawnRequest:
    """What to run: a script path (or module name with ``module``) and its arguments, with env and cwd."""

    target: str
    args: list[str]
    module: bool
    env: dict[str, str]
    cwd: str
    # the descriptors (1 stdout, 2 stderr) the trainer gets from the supervisor instead of its own (see
    # ftrun.launch.output); they follow the request on the socket (SCM_RIGHTS) once the zygote asks for them
    stdio: list[int] = field(default_factory=list)


class ZygoteClient:
    """The supervisor's handle on its zygote, forked from the calling process when made: make it before any
    thread starts. :meth:`close` ends the zygote."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        supervisor = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _zygote(theirs, supervisor)
        theirs.close()
        self.pid = pid
        self._sock = ours
        self._file = ours.makefile("rwb")
        self._preloaded = False

    def _receive(self) -> dict[str, object]:
        line = self._file.readline()
        if not line:
            raise RuntimeError("zygote exited")
        return json.loads(line)

    def spawn(self, request: SpawnRequest, timeout: float = SPAWN_TIMEOUT, fds: Sequence[int] = ()) -> int:
        """Fork a trainer; returns its pid (a child of the calling supervisor by then). ``fds``: the descriptors
        for ``request.stdio``, in its order."""
        self._sock.settimeout(timeout)
        self._file.write((json.dumps(asdict(request)) + "\n").encode())
        self._file.flush()
        reply = self._receive()
        if "send_fds" in reply:  # asked for once the zygote has read the request: nothing else is in flight
            socket.send_fds(self._sock, [b"F"], list(fds))
            reply = self._receive()
        if "pid" not in reply:
            raise RuntimeError(f"zygote could not start the trainer: {reply.get('error')}")
        return int(reply["pid"])  # type: ignore[arg-type]

    def preload(self) -> None:
        """Have the zygote import :data:`PRELOAD` now (once; a spawn asked meanwhile waits for it)."""
        if self._preloaded:
            return
        self._preloaded = True
        try:
            self._file.write(b'{"preload": true}\n')
            self._file.flush()
        except OSError:
            pass  # it died: the next spawn says so

    def close(self) -> None:
        """Stop the zygote (the caller reaps it)."""
        try:
            self._file.close()
            self._sock.close()
        finally:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _serve(sock: socket.socket, supervisor: int) -> SpawnRequest | None:
    """Answer spawn requests; returns only inside a newly forked trainer, with what it must run."""
    stream = sock.makefile("rwb")
    for line in stream:
        try:
            doc = json.loads(line)
            if doc == {"preload": True}:
                _preload()
                continue
            request = SpawnRequest(**doc)
        except (TypeError, ValueError) as err:
            stream.write((json.dumps({"error": f"bad request: {err}"}) + "\n").encode())
            stream.flush()
            continue
        stdio: list[int] = []
        if request.stdio:
            stream.write((json.dumps({"send_fds": len(request.stdio)}) + "\n").encode())
            stream.flush()
            _, stdio, _, _ = socket.recv_fds(sock, 1, len(request.stdio))
            if len(stdio) != len(request.stdio):
                _close_all(stdio)
                stream.write((json.dumps({"error": f"got {len(stdio)} of {len(request.stdio)} descriptors"})
                              + "\n").encode())
                stream.flush()
                continue
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        intermediate = os.fork()
        if intermediate == 0:
            os.close(read_end)
            trainer = os.fork()
            if trainer == 0:
                os.close(write_end)
                stream.close()
                sock.close()
                for target, fd in zip(request.stdio, stdio):
                    os.dup2(fd, target)
                _close_all(stdio)
                for forwarded in FORWARDED_SIGNALS.values():  # ignored by the supervisor this was forked from
                    signal.signal(forwarded, signal.SIG_DFL)  # until it handled them; a trainer's own default
                _become_trainer(supervisor)
                return request
            os.write(write_end, str(trainer).encode())
            os._exit(0)
        _close_all(stdio)  # the trainer has them
        os.close(write_end)
        pid = os.read(read_end, 32)
        os.close(read_end)
        os.waitpid(intermediate, 0)
        stream.write((json.dumps({"pid": int(pid)} if pid else {"error": "fork failed"}) + "\n").encode())
        stream.flush()
    return None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _become_trainer(supervisor: int) -> None:
    os.setsid()
    deadline = time.monotonic() + _REPARENT_TIMEOUT
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0002)
    die_with_parent(supervisor)


def _run(request: SpawnRequest) -> None:
    """Turn this forked process into the trainer: environment, directory, then the user's code
    (:func:`~ftrun.launch.bootstrap.run_main`: argv, sys.path, a clean traceback and the error file)."""
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[attr-defined]
    threads = request.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    # as `python script.py` would: a failure's traceback shows the user's frames only, and exits 1
    run_main(request.target, request.args, request.module)


def _preload() -> None:
    """Import :data:`PRELOAD` in a thread of the lowest priority (the import is seconds of CPU that the running
    trainers would otherwise share), and wait for it. Trainers are forked from the main thread, whose priority
    stays as it was."""
    def run() -> None:
        lower_priority(idle_io=False)
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # best effort: a trainer imports what it uses itself
                pass

    importer = threading.Thread(target=run, name="ftrun-preload")
    importer.start()
    importer.join()


def _zygote(sock: socket.socket, supervisor: int) -> NoReturn:
    """The forked child: serve, or, in a trainer forked from here, run the user's code and exit as Python would
    (by SystemExit through the supervisor's own frames, which hold no cleanup that must not run here)."""
    die_with_parent(supervisor)
    set_process_name(ZYGOTE_NAME)  # its argv is the launcher's (all are forks of it)
    request = _serve(sock, supervisor)
    if request is None:  # the supervisor closed the socket
        os._exit(0)
    set_process_name(os.path.basename(sys.executable))  # as a trainer started by torchrun shows
    _run(request)
    sys.exit(0)
