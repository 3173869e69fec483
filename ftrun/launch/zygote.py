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

Ready trainers. Those two forks and the intermediate's exit take about 15 ms per trainer, one trainer after the
other: 120 ms of every restart of a node with 8 trainers. So the zygote forks its trainers ahead: it keeps
``ready`` of them (the node's trainers per generation) forked, re-parented and waiting, each on a socket pair
of its own, and a request is handed to one of them (its descriptors, then the request's line:
:func:`~ftrun.snapshot.protocol.send_handoff`): the answer comes at once. The zygote forks them again once no
request came for :data:`REFILL_QUIET` seconds (after a generation's trainers started, not between them), and one
that is not ready when asked is forked then, as before. A waiting trainer is named
:data:`~ftrun.launch.processes.READY_NAME`; it has run nothing of the user's, holds no descriptor of the zygote's
but the standard ones, and exits when its socket closes (the zygote is gone) or with the supervisor. Invariant:
a trainer runs exactly one request, with nothing in its process that another request left.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import io
import json
import os
import select
import socket
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import NoReturn

from threadpoolctl import ThreadpoolController

from ftrun.control.spec import FORWARDED_SIGNALS
from ftrun.launch.bootstrap import run_main
from ftrun.launch.env import CPP_LOG_LEVEL, ENV_QUIET_CPP_LOG, thread_count
from ftrun.launch.processes import READY_NAME, ZYGOTE_NAME, die_with_parent, set_process_name
from ftrun.snapshot.protocol import receive_handoff, send_handoff

# imported by the supervisor before the fork: torch, torch.distributed. By preload(): torch._dynamo, which
# DistributedDataParallel and the optimizers' first step import (1-4 s per trainer otherwise).
PRELOAD = ("torch.nn.parallel", "torch._dynamo", "numpy")
SPAWN_TIMEOUT = 60.0  # seconds for one fork, the zygote's own preload() included where it makes it
REFILL_QUIET = 0.5  # seconds without a request before the zygote forks ready trainers again
_REPARENT_TIMEOUT = 5.0
_REPARENTED = b"P"  # a trainer's first byte to the zygote: it is the supervisor's child now
# A BLAS library (numpy's OpenBLAS) sizes its thread pool when it is loaded, before ftrun sets the trainers'
# OMP_NUM_THREADS (1 with several trainers, as torchrun): size_blas() sets it again (threadpoolctl, which finds
# whichever BLAS is loaded), unless one of these, read by a BLAS before OMP_NUM_THREADS, was set by the user
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS")


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
    thread starts. The zygote keeps ``ready`` trainers forked ahead (module docstring). :meth:`close` ends
    the zygote."""

    def __init__(self, ready: int = 0) -> None:
        ours, theirs = socket.socketpair()
        supervisor = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _zygote(theirs, supervisor, ready)
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


@dataclass
class _Ready:
    """A trainer forked ahead, waiting for its request on ``sock``."""

    pid: int
    sock: socket.socket


def _serve(sock: socket.socket, supervisor: int, ready: int) -> SpawnRequest | None:
    """Answer spawn requests, keeping ``ready`` trainers forked ahead; returns only inside a trainer, with what
    it must run."""
    stream = sock.makefile("rwb")
    waiting: list[_Ready] = []
    last_request = -REFILL_QUIET

    def fork_ready() -> _Ready | SpawnRequest:
        return _fork_ready(supervisor, [stream, sock, *(r.sock for r in waiting)])

    while True:
        if len(waiting) < ready and not select.select([sock], [], [], max(
                0.0, last_request + REFILL_QUIET - time.monotonic()))[0]:
            try:
                made = fork_ready()
            except OSError:  # no more processes now (a limit): fork when asked, as without ready ones
                ready = len(waiting)
                continue
            if isinstance(made, SpawnRequest):
                return made
            waiting.append(made)
            continue
        line = stream.readline()
        if not line:
            return None  # the supervisor closed the socket
        last_request = time.monotonic()
        try:
            request = SpawnRequest(**json.loads(line))
        except (TypeError, ValueError) as err:
            _answer(stream, {"error": f"bad request: {err}"})
            continue
        stdio: list[int] = []
        if request.stdio:
            _answer(stream, {"send_fds": len(request.stdio)})
            _, stdio, _, _ = socket.recv_fds(sock, 1, len(request.stdio))
            if len(stdio) != len(request.stdio):
                _close_all(stdio)
                _answer(stream, {"error": f"got {len(stdio)} of {len(request.stdio)} descriptors"})
                continue
        try:
            while True:  # a ready trainer that died meanwhile is skipped (the supervisor reaps it)
                trainer = waiting.pop() if waiting else fork_ready()
                if isinstance(trainer, SpawnRequest):
                    return trainer
                if send_handoff(trainer.sock, line, stdio):
                    break
        except OSError as err:
            _answer(stream, {"error": f"fork failed: {err}"})
            continue
        finally:
            _close_all(stdio)  # the trainer has them
        _answer(stream, {"pid": trainer.pid})


def _answer(stream: io.BufferedRWPair, reply: dict[str, object]) -> None:
    stream.write((json.dumps(reply) + "\n").encode())
    stream.flush()


def _fork_ready(supervisor: int, zygote_files: Sequence[socket.socket | io.IOBase]) -> _Ready | SpawnRequest:
    """Fork a trainer that waits, re-parented to ``supervisor``, for its request: its handle here; in the
    trainer, once the request came, the request. ``zygote_files``: what the trainer closes (the zygote's sockets
    and their streams)."""
    sys.stdout.flush()
    sys.stderr.flush()
    ours, theirs = socket.socketpair()
    read_end, write_end = os.pipe()
    gc.freeze()  # everything made so far: the trainer's collections skip it (module docstring)
    intermediate = os.fork()
    if intermediate == 0:
        trainer = -1
        try:
            os.close(read_end)
            trainer = os.fork()
            if trainer == 0:
                return _become_ready(supervisor, theirs, [write_end], [ours, *zygote_files])
            os.write(write_end, str(trainer).encode())
        finally:
            if trainer != 0:  # never back into the zygote's loop (an error included)
                os._exit(0)
    theirs.close()
    os.close(write_end)
    pid = os.read(read_end, 32)
    os.close(read_end)
    os.waitpid(intermediate, 0)
    if not pid or ours.recv(1) != _REPARENTED:  # the supervisor's child from here on, or gone
        ours.close()
        raise OSError("the trainer was not forked" if not pid else "the trainer was not re-parented to the "
                      "supervisor (is it a child subreaper?)")
    return _Ready(int(pid), ours)


def _become_ready(supervisor: int, sock: socket.socket, fds: list[int],
                  files: Sequence[socket.socket | io.IOBase]) -> SpawnRequest:
    """In a trainer just forked: close the zygote's ``fds`` and ``files``, become the supervisor's child, tell the
    zygote, and wait on ``sock`` for the request. Any error (the zygote went away) ends the process: it never runs
    the zygote's code again."""
    try:
        _close_all(fds)
        for file in files:
            file.close()
        _become_trainer(supervisor)
        sock.sendall(_REPARENTED)
        return _await_request(sock)
    except BaseException:  # noqa: BLE001 - nothing of the zygote's may run in a trainer
        os._exit(1)


def _await_request(sock: socket.socket) -> SpawnRequest:
    """In a ready trainer: wait for the request, take its descriptors as stdout/stderr; exit when the zygote
    closed the socket without one."""
    set_process_name(READY_NAME)
    line, stdio = receive_handoff(sock, 2)
    if not line:
        os._exit(0)
    request = SpawnRequest(**json.loads(line))
    for target, fd in zip(request.stdio, stdio):
        os.dup2(fd, target)
    _close_all(stdio)
    return request


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
    # SLURM's warnings and the signals they are forwarded as, ignored by the supervisor this was forked from until
    # it handled them (ftrun.launch.handoff.prepare_supervisor), and so until now: a trainer's own default
    for forwarded in (*FORWARDED_SIGNALS, *FORWARDED_SIGNALS.values()):
        signal.signal(forwarded, signal.SIG_DFL)
    quieted = os.environ.get(ENV_QUIET_CPP_LOG)  # this process's torch logs C++ warnings at ftrun's ERROR
    os.environ.clear()
    os.environ.update(request.env)
    if quieted:
        _user_cpp_log_level()
    os.chdir(request.cwd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[attr-defined]
    _fresh_randomness()
    threads = thread_count(request.env.get("OMP_NUM_THREADS", ""))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    # as `python script.py` would: a failure's traceback shows the user's frames only, and exits 1
    run_main(request.target, request.args, request.module)


def _user_cpp_log_level() -> None:
    """Give the trainer the C++ log level of the user's environment (torch's default, WARNING, where it sets
    none), as a new interpreter would have: torch reads ``TORCH_CPP_LOG_LEVEL`` once, at its import, and this
    process imported it with the ERROR that ftrun's own processes run at (:mod:`ftrun.launch.env`), which would
    hide every warning of torch's C++ code (DDP's, gloo's, NCCL's). ``c10::initLogging`` (c10/util/Logging.h, a
    public function of torch's C++ API) reads it again; a torch without it keeps ERROR."""
    import torch

    wanted = os.environ.get(CPP_LOG_LEVEL)
    os.environ[CPP_LOG_LEVEL] = wanted or "WARNING"
    try:
        ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))._ZN3c1011initLoggingEv()
    except (OSError, AttributeError):
        pass
    finally:
        if wanted is None:
            del os.environ[CPP_LOG_LEVEL]


def _fresh_randomness() -> None:
    """Draw again from the OS what a new interpreter draws and a fork shares with its siblings: the seed of
    torch's default generator (``import torch`` seeds it at random; CUDA's stay unseeded until used, as in a new
    interpreter), numpy's global ``RandomState`` and ``multiprocessing``'s authentication key. Python's
    ``random`` reseeds itself in a fork. (The seed of ``hash()`` of strings cannot change after the start: every
    trainer of a host shares it.)"""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is not None:
        multiprocessing.current_process().authkey = os.urandom(32)


def preload() -> None:
    """Import :data:`PRELOAD` (what is already imported costs nothing) and freeze every object made so far
    (module docstring). Only in a process that has no thread of its own yet: it forks next."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # best effort: a trainer imports what it uses itself
            pass
    gc.freeze()


def size_blas(threads: int | None) -> None:
    """Size the thread pool of the BLAS that numpy loaded (OpenBLAS, MKL, BLIS) to ``threads``, the trainers'
    OMP_NUM_THREADS, as a new interpreter's numpy would at its import: in the process that loaded it, before it
    forks the zygote (its trainers inherit the size). Nothing where the size is right already, where ``threads``
    is None (the user's OMP_NUM_THREADS is not a number) or where the user set a BLAS's own variable.

    Not in a trainer: a fork has no BLAS threads (OpenBLAS stops them before each fork), and resizing there starts
    one that spins for about 0.1 s, which slowed every restart by as much on this host."""
    if threads is None or any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return
    for library in ThreadpoolController().select(user_api="blas").lib_controllers:
        if library.num_threads != threads:
            library.set_num_threads(threads)


def _zygote(sock: socket.socket, supervisor: int, ready: int) -> NoReturn:
    """The forked child: serve, or, in a trainer forked from here, run the user's code and exit as Python would
    (by SystemExit through the supervisor's own frames, which hold no cleanup that must not run here)."""
    die_with_parent(supervisor)
    set_process_name(ZYGOTE_NAME)  # its argv is the launcher's (all are forks of it)
    preload()  # nothing to do where the launcher did it before forking the supervisor
    request = _serve(sock, supervisor, ready)
    if request is None:  # the supervisor closed the socket
        os._exit(0)
    set_process_name(os.path.basename(sys.executable))  # as a trainer started by torchrun shows
    _run(request)
    sys.exit(0)
