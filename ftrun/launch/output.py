"""Where a trainer's stdout and stderr go: torchrun's ``--redirects``/``--tee``/``--local-ranks-filter``/
``--duplicate-std{out,err}-filters``, and ftrun's ``--label-output``.

Without any of them a trainer writes straight to the stdout/stderr it inherits from its supervisor: no pipe,
no thread, no cost. Otherwise each stream of each trainer is, by what it needs:

- hidden (``--local-ranks-filter`` leaves its rank out, and no file): ``/dev/null``;
- a file only (``--redirects``): ``<log dir>/gen<g>/rank<r>/stdout.log`` (``stderr.log``) opened by the
  supervisor and given to the trainer as its descriptor;
- the console only, unlabelled: inherited, as without any flag;
- anything else (``--tee``: the file and the console; ``--label-output``): a pipe read by a thread of the
  supervisor, which writes the bytes to the file as they come and complete lines, prefixed, to the console
  (and, with ``--duplicate-*-filters``, the matching ones to ``gen<g>/node<n>/filtered_std{out,err}.log``).

A stream's value is torchrun's: ``0`` none, ``1`` stdout, ``2`` stderr, ``3`` both, for every local rank, or per
local rank as ``LOCAL_RANK:VALUE,...`` (``0:3,1:2``). Console lines that are teed carry torchrun's prefix
``[<role><local rank>]:`` (``$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` as torchrun reads it); with
``--label-output`` every console line of a trainer carries ``[rank <global rank>] `` instead.

The first supervisor of a node in a run puts what an earlier run left in its ranks' directories aside
(:func:`keep_earlier_logs`), so nothing is written over.

The supervisor drains a trainer's pipes (:meth:`Output.drain`) before it reports the trainer's exit, so its
last lines come before the failure they explain.
"""

from __future__ import annotations

import array
import fcntl
import glob
import os
import re
import select
import termios
import threading
import time
from dataclasses import dataclass
from string import Template

from ftrun.errors import UsageError, error_text
from ftrun.events import EventLog

OUT, ERR = 1, 2  # the bits of a stream value, and the descriptors they are on
STREAM_FILES = {OUT: "stdout.log", ERR: "stderr.log"}
FILTERED_FILES = {OUT: "filtered_stdout.log", ERR: "filtered_stderr.log"}
ENV_PREFIX_TEMPLATE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
DRAIN_TIMEOUT = 1.0  # at most this long for a trainer's pipes to empty (a child it left may keep them open)
_CHUNK = 1 << 16
_VALUE = re.compile(r"^[0-3]$")
_MAPPING = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")
_CONSOLE_LOCK = threading.Lock()  # whole lines of different trainers never interleave on the console


def parse_streams(value: str, flag: str) -> int | dict[int, int]:
    """torchrun's stream value: ``"3"`` -> 3, ``"0:1,1:2"`` -> {0: 1, 1: 2}; a :class:`UsageError` otherwise."""
    text = str(value).strip()
    if _VALUE.match(text):
        return int(text)
    if _MAPPING.match(text):
        return {int(rank): int(bits) for rank, bits in (item.split(":") for item in text.split(","))}
    raise UsageError(f"{flag} must be 0, 1 (stdout), 2 (stderr) or 3 (both) for every local rank, or "
                     f"LOCAL_RANK:VALUE,... (e.g. 0:3,1:2); got {text!r}")


def parse_ranks_filter(value: str | None) -> set[int] | None:
    """``--local-ranks-filter 0,1`` -> {0, 1}; empty or None -> None (every rank shown)."""
    if value is None or not str(value).strip():
        return None
    try:
        ranks = {int(item) for item in str(value).split(",")}
    except ValueError:
        raise UsageError(f"--local-ranks-filter must be a comma-separated list of local ranks, e.g. 0,1,2; "
                         f"got {value!r}") from None
    if any(rank < 0 for rank in ranks):
        raise UsageError(f"--local-ranks-filter: local ranks are 0 or more, got {value!r}")
    return ranks


def split_filters(value: str) -> list[str]:
    """torchrun's ``--duplicate-*-filters`` list: comma-separated, ``,,`` stands for a comma."""
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",") if item]


def _bits(value: int | dict[int, int], local_rank: int) -> int:
    return value.get(local_rank, 0) if isinstance(value, dict) else value


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:  # a closed console or a full disk loses output, never the training
            return


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe ``fd``."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


class _Sink:
    """A file several pumps write whole lines to (the filtered lines of one node's trainers)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None  # opened with the first matching line
        self.lock = threading.Lock()
        self.closed = False

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.closed:  # a child the trainer left writes on after its generation: dropped
                return
            if self.fd is None:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            _write_all(self.fd, data)

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
            self.fd, self.closed = None, True


class _Pump(threading.Thread):
    """Reads one trainer stream's pipe until EOF: every byte to its file, complete lines (prefixed) to the
    console, lines matching a filter to the node's filtered file."""

    def __init__(self, fd: int, file: int | None, console: int | None, prefix: bytes, dup: _Sink | None,
                 filters: list[bytes]) -> None:
        super().__init__(name=f"ftrun-output-{fd}", daemon=True)
        os.set_blocking(fd, False)
        self.fd, self.file, self.console, self.prefix = fd, file, console, prefix
        self.dup, self.filters = dup, filters
        self.pending = b""
        self.lock = threading.Lock()  # held while a chunk is read and written: drain() then sees it all
        self.eof = self.closed = False

    def run(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        try:
            while True:
                poller.poll()
                with self.lock:
                    try:
                        data = os.read(self.fd, _CHUNK)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        self._flush_partial()
                        self.eof = True
                        self._close_file()
                        return
                    if not self.closed:
                        self._take(data)
        finally:
            os.close(self.fd)

    def _take(self, data: bytes) -> None:
        if self.file is not None:
            _write_all(self.file, data)
        if self.console is None and self.dup is None:
            return
        data = self.pending + data
        cut = data.rfind(b"\n") + 1
        self.pending = data[cut:]
        if cut:
            self._lines(data[:cut].split(b"\n")[:-1])

    def _lines(self, lines: list[bytes]) -> None:
        if self.console is not None:
            block = b"".join(self.prefix + line + b"\n" for line in lines)
            with _CONSOLE_LOCK:
                _write_all(self.console, block)
        if self.dup is not None:
            matched = [self.prefix + line + b"\n" for line in lines if any(f in line for f in self.filters)]
            if matched:
                self.dup.write(b"".join(matched))

    def _flush_partial(self) -> None:
        if self.pending and not self.closed:
            self._lines([self.pending])
        self.pending = b""

    def _close_file(self) -> None:
        if self.file is not None:
            os.close(self.file)
            self.file = None

    def drain(self, deadline: float) -> None:
        """Return once everything written to the pipe so far is written out (or at ``deadline``)."""
        while True:
            with self.lock:
                if self.eof or _unread(self.fd) == 0:
                    if not self.eof:  # the trainer is gone but something it left holds the pipe: end its line
                        self._flush_partial()
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.001)

    def close(self) -> None:
        """Stop writing anywhere (the thread keeps reading, and dropping, until EOF); close the file."""
        with self.lock:
            self.closed = True
            self._close_file()


@dataclass(frozen=True)
class OutputSettings:
    """The output flags of a job, as a supervisor gets them in its node spec."""

    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    label_output: bool = False

    @property
    def default(self) -> bool:
        """Nothing asked for: every trainer keeps its inherited stdout/stderr."""
        return (parse_streams(self.redirects, "--redirects") == 0 and parse_streams(self.tee, "--tee") == 0
                and parse_ranks_filter(self.local_ranks_filter) is None and not self.label_output)

    @property
    def writes_files(self) -> bool:
        """Whether some stream of some rank goes to a file (a log directory is needed)."""
        return parse_streams(self.redirects, "--redirects") != 0 or parse_streams(self.tee, "--tee") != 0

    def validate(self) -> None:
        parse_streams(self.redirects, "--redirects")
        parse_streams(self.tee, "--tee")
        parse_ranks_filter(self.local_ranks_filter)


class Output:
    """Routes the streams of one node's trainers, generation after generation."""

    def __init__(self, settings: OutputSettings, log_dir: str | None, node: int, role: str = "default") -> None:
        self.active = not settings.default
        self.redirects = parse_streams(settings.redirects, "--redirects")
        self.tee = parse_streams(settings.tee, "--tee")
        self.shown = parse_ranks_filter(settings.local_ranks_filter)
        self.filters = {OUT: [f.encode() for f in settings.duplicate_stdout_filters],
                        ERR: [f.encode() for f in settings.duplicate_stderr_filters]}
        self.label = settings.label_output
        self.log_dir = log_dir
        self.node = node
        self.role = role
        self.template = os.environ.get(ENV_PREFIX_TEMPLATE)
        self._pumps: dict[int, list[_Pump]] = {}  # rank -> its pumps
        self._sinks: dict[tuple[int, int], _Sink] = {}  # (generation, stream) -> the node's filtered file

    def open(self, gen: int, rank: int, local_rank: int) -> dict[int, int]:
        """The descriptors to give the trainer of ``rank``: {1: fd, 2: fd}, a stream left out is inherited.
        Pass them to the trainer, then :meth:`spawned` them."""
        if not self.active:
            return {}
        fds: dict[int, int] = {}
        try:
            for stream in (OUT, ERR):
                fd = self._open_stream(gen, rank, local_rank, stream)
                if fd is not None:
                    fds[stream] = fd
        except OSError:
            self.spawned(fds)
            raise
        return fds

    def _open_stream(self, gen: int, rank: int, local_rank: int, stream: int) -> int | None:
        redirected = bool(_bits(self.redirects, local_rank) & stream)
        teed = bool(_bits(self.tee, local_rank) & stream)
        shown = self.shown is None or local_rank in self.shown
        to_file, to_console = redirected or teed, shown and (teed or not redirected)
        filters = self.filters[stream] if teed and to_console else []
        if not to_file and not to_console:
            return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        file = None
        if to_file:
            assert self.log_dir is not None, "--redirects/--tee need a log directory (the launcher makes one)"
            directory = os.path.join(self.log_dir, f"gen{gen}", f"rank{rank}")
            os.makedirs(directory, exist_ok=True)
            file = os.open(os.path.join(directory, STREAM_FILES[stream]),
                           os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        prefix = self._prefix(rank, local_rank) if self.label or teed else b""
        if not to_console:
            return file  # the trainer writes its file itself
        if file is None and not prefix:
            return None  # inherited
        read_end, write_end = os.pipe()
        dup = None
        if filters:
            assert self.log_dir is not None
            dup = self._sinks.get((gen, stream))
            if dup is None:
                path = os.path.join(self.log_dir, f"gen{gen}", f"node{self.node}", FILTERED_FILES[stream])
                dup = self._sinks[(gen, stream)] = _Sink(path)
        pump = _Pump(read_end, file, stream, prefix, dup, filters)  # the console: this process's fd 1 or 2
        self._pumps.setdefault(rank, []).append(pump)
        pump.start()
        return write_end

    def _prefix(self, rank: int, local_rank: int) -> bytes:
        if self.label:
            return f"[rank {rank}] ".encode()
        if self.template:
            return Template(self.template).safe_substitute(role_name=self.role, rank=rank,
                                                           local_rank=local_rank).encode()
        return f"[{self.role}{local_rank}]:".encode()

    @staticmethod
    def spawned(fds: dict[int, int]) -> None:
        """Close this process's copies of what :meth:`open` gave a trainer (it has its own now)."""
        for fd in fds.values():
            os.close(fd)

    def drain(self, rank: int, timeout: float = DRAIN_TIMEOUT) -> None:
        """Write out what the (exited) trainer of ``rank`` wrote before it ended."""
        deadline = time.monotonic() + timeout
        for pump in self._pumps.get(rank, ()):
            pump.drain(deadline)

    def finish(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """After a generation's trainers are stopped: write out what is left and close its files."""
        deadline = time.monotonic() + timeout
        for pumps in self._pumps.values():
            for pump in pumps:
                pump.drain(deadline)
                pump.close()
        for sink in self._sinks.values():
            sink.close()
        self._pumps.clear()
        self._sinks.clear()


def keep_earlier_logs(log_dir: str, node: int, nproc: int, events: EventLog) -> None:
    """The first supervisor of node ``node`` in a run moves what an earlier run left in its ranks' directories
    (``gen<G>/rank<R>/``) to ``previous-<time>/gen<G>/rank<R>/``, as torchrun keeps each run's logs apart:
    nothing an earlier run wrote is overwritten, nor taken for this run's (its ``error.json`` for a new
    failure's cause)."""
    ranks = range(node * nproc, (node + 1) * nproc)
    gens = [path for path in glob.glob(os.path.join(glob.escape(log_dir), "gen*"))
            if re.fullmatch(r"gen\d+", os.path.basename(path))]
    found = [path for gen in sorted(gens) for rank in ranks
             if os.path.isdir(path := os.path.join(gen, f"rank{rank}"))]
    if not found:
        return
    aside = os.path.join(log_dir, time.strftime("previous-%Y%m%d-%H%M%S"))
    try:
        for path in found:
            gen_dir = os.path.join(aside, os.path.basename(os.path.dirname(path)))
            os.makedirs(gen_dir, exist_ok=True)
            os.rename(path, os.path.join(gen_dir, os.path.basename(path)))
    except OSError as err:
        events.emit("logs", f"WARNING cannot move the logs an earlier run left in {log_dir} aside "
                    f"({error_text(err)}): this run's trainers write over them", node=node)
        return
    events.emit("logs", f"moved what an earlier run left in {log_dir} for rank(s) {ranks.start}-"
                f"{ranks.stop - 1} to {aside}", node=node, path=aside)
