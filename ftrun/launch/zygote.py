"""The zygote: a long-lived process per node that has imported torch and forks ready trainers in milliseconds.

Starting a trainer the usual way costs a new interpreter and ``import torch`` (2-3 s here, 8 s for four at
once); a fork of a process that already imported torch is ready in about 6 ms. The zygote never runs a torch
operation (a fork after a multi-threaded torch op hangs the child) and never initialises CUDA.

Protocol on the socket the supervisor passes as argv[1], one JSON document per line:

- zygote -> supervisor, once: ``{"ready": true}`` after the preloads.
- supervisor -> zygote: a :class:`SpawnRequest`; zygote -> supervisor: ``{"pid": N}`` or ``{"error": "..."}``.

Each trainer is forked twice (zygote -> intermediate -> trainer) and the intermediate exits at once, so the
trainer is re-parented to the supervisor, a child subreaper: the supervisor then waits for it like any child
and sees its exit status within one poll. The trainer leads its own session, and arms PR_SET_PDEATHSIG only
once it is the supervisor's child, so it dies with the supervisor.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from ftrun.launch.processes import die_with_parent

# torch._dynamo: DistributedDataParallel imports it on construction (1-4 s per trainer otherwise).
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "numpy")
_REPARENT_TIMEOUT = 5.0


@dataclass(frozen=True)
class SpawnRequest:
    """What to run: a script path (or module name with ``module``) and its arguments, with env and cwd."""

    target: str
    args: list[str]
    module: bool
    env: dict[str, str]
    cwd: str


class ZygoteClient:
    """The supervisor's handle on its zygote; :meth:`close` kills it."""

    def __init__(self, ready_timeout: float = 120.0) -> None:
        ours, theirs = socket.socketpair()
        supervisor = os.getpid()
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "ftrun.launch.zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), preexec_fn=lambda: die_with_parent(supervisor),
        )
        theirs.close()
        self.pid = self._proc.pid
        self._sock = ours
        self._sock.settimeout(ready_timeout)
        self._file = ours.makefile("rwb")
        reply = self._receive()
        if not reply.get("ready"):
            raise RuntimeError(f"zygote did not start: {reply}")

    def _receive(self) -> dict[str, object]:
        line = self._file.readline()
        if not line:
            raise RuntimeError("zygote exited")
        return json.loads(line)

    def spawn(self, request: SpawnRequest, timeout: float = 10.0) -> int:
        """Fork a trainer; returns its pid (a child of the calling supervisor by then)."""
        self._sock.settimeout(timeout)
        self._file.write((json.dumps(asdict(request)) + "\n").encode())
        self._file.flush()
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
            if self._proc.returncode is None:
                try:
                    self._proc.kill()
                except ProcessLookupError:
                    pass


def _serve(sock: socket.socket, supervisor: int) -> SpawnRequest | None:
    """Answer spawn requests; returns only inside a newly forked trainer, with what it must run."""
    stream = sock.makefile("rwb")
    stream.write(b'{"ready": true}\n')
    stream.flush()
    for line in stream:
        try:
            request = SpawnRequest(**json.loads(line))
        except (TypeError, ValueError) as err:
            stream.write((json.dumps({"error": f"bad request: {err}"}) + "\n").encode())
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
                _become_trainer(supervisor)
                return request
            os.write(write_end, str(trainer).encode())
            os._exit(0)
        os.close(write_end)
        pid = os.read(read_end, 32)
        os.close(read_end)
        os.waitpid(intermediate, 0)
        stream.write((json.dumps({"pid": int(pid)} if pid else {"error": "fork failed"}) + "\n").encode())
        stream.flush()
    return None


def _become_trainer(supervisor: int) -> None:
    os.setsid()
    deadline = time.monotonic() + _REPARENT_TIMEOUT
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0002)
    die_with_parent(supervisor)


def _run(request: SpawnRequest) -> None:
    """Turn this forked process into the trainer: environment, directory, argv, then the user's code."""
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[attr-defined]
    threads = request.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [request.target, *request.args]
    if request.module:
        sys.path.insert(0, request.cwd)
        runpy.run_module(request.target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(request.target)))
        runpy.run_path(request.target, run_name="__main__")


def main() -> None:
    supervisor = os.getppid()
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    request = _serve(sock, supervisor)
    if request is None:
        return
    _run(request)


if __name__ == "__main__":
    main()
