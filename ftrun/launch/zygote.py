"""The zygote: a fork of its node's supervisor that has imported torch and forks ready trainers in milliseconds.

Starting a trainer the usual way costs a new interpreter and ``import torch`` (2-3 s here, 8 s for four at
once); a fork of a process that already imported torch is ready in about 6 ms. The supervisor imports torch
anyway, so the zygote is a plain fork of it, made before the supervisor starts any thread or connection
(:class:`ZygoteClient`): it costs no interpreter and no ``import torch`` of its own. The zygote never runs a torch
operation (a fork after a multi-threaded torch op hangs the child) and never initialises CUDA.

What training scripts import next (:data:`PRELOAD`: DDP and the optimizers import ``torch._dynamo``, 1.8 s and
70 MB here) is imported once, before the first trainer, by :func:`preload`: in the launcher before it forks
the supervisors (once per host), else by the zygote as it starts. Every trainer then starts with it, shares its
pages, and spends neither the import (1.8 s of CPU each, at its first step) nor the memory; a script that never
imports it waits for it once per job. Before each fork the zygote moves every object it has to the garbage
collector's permanent generation (``gc.freeze``): a trainer's collections, its interpreter teardown at exit
included, then never walk the 280,000 objects of torch and dynamo, nor copy the pages that hold them (a full
collection, which pauses a training step, took 147 ms here; a trainer's exit 2.7 s, now 1.0 s).

Protocol on the socket pair, one JSON document per line:

- supervisor -> zygote: a :class:`SpawnRequest`; zygote -> supervisor: ``{"pid": N}`` or ``{"error": "..."}``.
  A request with ``stdio`` is answered ``{"send_fds": N}`` first; the supervisor then sends one byte carrying
  the N descriptors (SCM_RIGHTS), which the trainer gets as its stdout/stderr.

Each trainer is forked twice (zygote -> intermediate -> trainer) and the intermediate exits at once, so the
trainer is re-parented to the supervisor, a child subreaper: the supervisor then waits for it like any child
and sees its exit status within one poll. The trainer leads its own session, and arms PR_SET_PDEATHSIG only
once it is the supervisor's child, so it dies with the supervisor.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import socket
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import NoReturn

from ftrun.control.spec import FORWARDED_SIGNALS
from ftrun.launch.bootstrap import run_main
from ftrun.launch.processes import ZYGOTE_NAME, die_with_parent, set_process_name

# imported by the supervisor before the fork: torch, torch.distributed. By preload(): torch._dynamo, which
# DistributedDataParallel and the optimizers' first step import (1-4 s per trainer otherwise).
PRELOAD = ("torch.nn.parallel", "torch._dynamo", "numpy")
SPAWN_TIMEOUT = 60.0  # seconds for one fork, the zygote's own preload() included where it makes it
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
            request = SpawnRequest(**json.loads(line))
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
        gc.freeze()  # everything made so far: the trainer's collections skip it (module docstring)
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


def preload() -> None:
    """Import :data:`PRELOAD` (what is already imported costs nothing) and freeze every object made so far
    (module docstring). Only in a process that has no thread of its own yet: it forks next."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # best effort: a trainer imports what it uses itself
            pass
    gc.freeze()


def _zygote(sock: socket.socket, supervisor: int) -> NoReturn:
    """The forked child: serve, or, in a trainer forked from here, run the user's code and exit as Python would
    (by SystemExit through the supervisor's own frames, which hold no cleanup that must not run here)."""
    die_with_parent(supervisor)
    set_process_name(ZYGOTE_NAME)  # its argv is the launcher's (all are forks of it)
    preload()  # nothing to do where the launcher did it before forking the supervisor
    request = _serve(sock, supervisor)
    if request is None:  # the supervisor closed the socket
        os._exit(0)
    set_process_name(os.path.basename(sys.executable))  # as a trainer started by torchrun shows
    _run(request)
    sys.exit(0)
