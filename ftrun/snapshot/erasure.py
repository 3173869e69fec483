"""Erasure-coded redundancy of the nodes of an EC group: the rotated stripe layout and the Reed-Solomon codec.

A job's nodes form groups of ``G`` consecutive node ranks (node ``r`` is position ``r % G`` of group ``r // G``)
with ``m`` parity, ``k = G - m``. At a step, every node's *blob* (its ranks' slot images, one after the other) is
cut into ``k`` chunks of ``L`` bytes, ``L`` the same for the whole group (the largest blob over ``k``, rounded up
to :data:`ALIGN`; a short blob is padded with zeros). There are ``G`` stripes::

    stripe j:  data fragment i (i < k)  = chunk i of position (j + m + i) % G
               parity fragment k + t    held by position (j + t) % G            (t < m)

so parity rotates like RAID-6: every position holds its own blob, parity for ``m`` stripes (``m/k`` of a blob),
and is a data node of the other ``k``; chunk ``c`` of position ``p`` is data fragment ``c`` of stripe
``(p - m - c) % G``. Any ``m`` lost positions leave ``k`` fragments in every stripe, which rebuild the rest.

Fragments are coded in *pieces* of at most :data:`PIECE` bytes, pipelined: the fetches of piece i + 1 run
(in the caller's thread pool, one connection per thread) while piece i is coded, into two sets of reusable
buffers (:class:`Scratch`), so memory stays bounded and no Python object is made per byte. pyeclib's Reed-Solomon
codes are systematic: a data fragment's payload is the data piece itself. XOR parity (m = 1 with the
``*_rs_vand`` backends) and replication are numpy XORs and copies; the other fragments are ISA-L's combinations
with pyeclib's coefficients, or pyeclib's own where those do not apply (:class:`Codec`).

This module is computation and its schedule (no sockets, no files, no torch): the keeper passes callbacks that
fetch bytes from peers into the buffers given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from isal.isal_zlib import crc32
from pyeclib.ec_iface import ECDriver

from ftrun.snapshot.ec_groups import DEFAULT_BACKEND
from ftrun.snapshot.gf_kernels import PROBE, Combination, load_isal

ALIGN = 4096
PIECE = 8 << 20  # a pipeline step: fetches of piece i + 1 run while piece i is coded
CODE_PART = 128 << 10  # pyeclib codes a piece in parts this long, which stay in the core's cache (see Codec)
HEADER_BYTES = 80

Buffer = bytes | bytearray | memoryview
FetchInto = Callable[[int, int, int, memoryview], None]  # (fragment index, offset, length, into): fill into
SendPiece = Callable[[int, memoryview, int], None]  # (offset, piece, its CRC-32): hand a computed piece on


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class StripeLayout:
    """Where every fragment of every stripe of a group of ``group`` positions with ``parity`` parity lives."""

    group: int
    parity: int
    piece: int = PIECE  # largest coding piece; pieces of every fragment of the group together stay below 1 GiB

    @property
    def k(self) -> int:
        return self.group - self.parity

    def data_position(self, stripe: int, index: int) -> int:
        """The position whose chunk is data fragment ``index`` of ``stripe``."""
        return (stripe + self.parity + index) % self.group

    def parity_position(self, stripe: int, t: int) -> int:
        """The position that holds parity fragment ``k + t`` of ``stripe``."""
        return (stripe + t) % self.group

    def position(self, stripe: int, index: int) -> int:
        """The position holding fragment ``index`` (data below k, parity from k) of ``stripe``."""
        k = self.k
        return self.data_position(stripe, index) if index < k else self.parity_position(stripe, index - k)

    def chunk_stripe(self, position: int, chunk: int) -> int:
        """The stripe in which chunk ``chunk`` of ``position`` is data fragment ``chunk``."""
        return (position - self.parity - chunk) % self.group

    def parity_stripes(self, position: int) -> list[int]:
        """The stripes whose parity fragment ``k + t`` ``position`` holds, in order of t."""
        return [(position - t) % self.group for t in range(self.parity)]

    def chunk_len(self, blob_lens: Sequence[int]) -> int:
        """L: the chunk (and fragment) length of the group for these blob lengths."""
        return align(-(-max(blob_lens, default=0) // self.k)) if self.k else 0

    @property
    def piece_len(self) -> int:
        """The length of every coding piece but a fragment's last one."""
        return max(ALIGN, min(self.piece, (1 << 30) // self.group) // ALIGN * ALIGN)

    def pieces(self, chunk_len: int) -> list[tuple[int, int]]:
        """(offset, length) of the coding pieces of a fragment of ``chunk_len`` bytes."""
        piece = self.piece_len
        return [(o, min(piece, chunk_len - o)) for o in range(0, chunk_len, piece)]


class Codec:
    """Reed-Solomon over one stripe's pieces (``k`` data pieces of one aligned length); pyeclib defines the code.

    * Parity fragment ``k`` of the ``*_rs_vand`` backends is the XOR of the data pieces (:attr:`xor_first`,
      checked against pyeclib's own parity when the codec is made): encoding it, and rebuilding one data piece
      from it and the other k - 1, is a numpy XOR at memory speed. With ``k = 1`` (replication) every parity
      fragment is the data piece itself.
    * Otherwise each fragment computed (parity from the k data fragments, a lost piece from any k, one source's
      term of it) is a linear combination of its sources over GF(2^8). ISA-L's kernels compute it over the
      buffers themselves, with the GIL released, from coefficients learned from pyeclib and checked against it
      once per combination (:mod:`ftrun.snapshot.gf_kernels`): pyeclib's own bytes, 4 x faster than pyeclib here
      (10 x for a term), and several threads code at once.
    * Where ISA-L's kernels do not give pyeclib's bytes (``liberasurecode_rs_vand``'s field) or its library is not
      found, pyeclib computes: ``reconstruct`` of the wanted index from k fragments (parity too: the same bytes as
      ``encode``, about 8 x faster). It takes ``bytes`` (a header, then the payload: one copy of each fragment),
      allocates its fragments on every call and holds the GIL throughout: a keeper keeps those blocks in its heap
      (:mod:`ftrun.snapshot.heap`), and its fetches receive whole pieces without the GIL
      (:mod:`ftrun.snapshot.transport`). A piece is coded in parts of :data:`CODE_PART` bytes, one pyeclib call
      each, so that the copies and the coding of a part stay in the core's cache (k = 4, m = 2, one 8 MiB
      fragment: 7.7-8.9 ms whole, 3.5 ms in parts of 128 KiB).
    * Fragment headers (80 bytes each, which pyeclib needs) depend on the part's length only, never on the data
      (checked when the codec is made): :meth:`headers` makes them here, so no header that came over the network
      ever reaches pyeclib, and every payload handed to it has been checked to be ``length`` bytes: its C
      asserts on malformed fragments are unreachable.
    """

    def __init__(self, k: int, m: int, backend: str = DEFAULT_BACKEND) -> None:
        self.k, self.m, self.backend = k, m, backend
        self._headers: dict[int, list[bytes]] = {}
        self._zeros = b""  # add_term's stand-in for the other fragments (read only)
        self._terms = threading.local()  # add_term's output before it is XORed in: a buffer per thread
        self._combinations: dict[tuple[tuple[int, ...], int], Combination | None] = {}  # see _combination
        self._learning = threading.Lock()
        if k > 1:
            sample = [bytes((b * (3 + i)) & 0xFF for b in range(256)) * (ALIGN // 256) * k for i in range(2)]
            first, second = (self._driver.encode(raw) for raw in sample)
            if [f[:HEADER_BYTES] for f in first] != [f[:HEADER_BYTES] for f in second]:
                raise RuntimeError(f"{backend}: fragment headers depend on the data; not supported")
            size = len(sample[0]) // k
            xor = np.zeros(size, np.uint8)
            for i in range(k):
                np.bitwise_xor(xor, np.frombuffer(sample[0], np.uint8, size, i * size), out=xor)
            self.xor_first = first[k][HEADER_BYTES:] == xor.tobytes()
        else:
            self.xor_first = True

    @cached_property
    def _driver(self) -> ECDriver:
        return ECDriver(k=self.k, m=self.m, ec_type=self.backend)

    def headers(self, length: int) -> list[bytes]:
        """The k + m fragment headers of ``length`` bytes coded in one call (a multiple of :data:`ALIGN`)."""
        if length <= 0 or length % ALIGN:
            raise ValueError(f"piece length {length} is not a positive multiple of {ALIGN}")
        if length not in self._headers:
            fragments = self._driver.encode(bytes(self.k * length))
            if any(len(f) != HEADER_BYTES + length for f in fragments):
                raise RuntimeError(f"{self.backend}: unexpected fragment size (not systematic on aligned pieces)")
            self._headers[length] = [bytes(f[:HEADER_BYTES]) for f in fragments]
        return self._headers[length]

    def xor_parity(self, t: int) -> bool:
        """Whether parity fragment ``k + t`` is the XOR of the data pieces."""
        return t == 0 and self.xor_first or self.k == 1

    def parity(self, pieces: Sequence[Buffer], t: int, into: memoryview) -> None:
        """Parity fragment ``k + t`` of one piece into ``into``, from the k data pieces (each ``len(into)``
        bytes)."""
        self._reconstruct(dict(enumerate(pieces)), self.k + t, into)

    def reconstruct(self, available: Mapping[int, Buffer], want: int, into: memoryview) -> None:
        """Fragment ``want`` of one piece into ``into``, from ``k`` other fragments of the piece (by index)."""
        if len(available) < self.k:
            raise ValueError(f"{len(available)} fragments available, {self.k} needed")
        self._reconstruct({i: available[i] for i in sorted(available)[:self.k]}, want, into)

    def add_term(self, terms: Terms, index: int, piece: Buffer, into: memoryview) -> None:
        """``into ^=`` the term of fragment ``index`` (``piece``: the bytes of it at the same offsets as ``into``'s,
        starting at a multiple of :data:`ALIGN`) in ``terms``' reconstruction of fragment ``terms.want`` from the
        k fragments ``terms.sources``. Reconstruction is linear over GF(2^8), byte by byte: fragment ``want`` is
        the XOR of the terms of its k sources. ISA-L adds the term in (:mod:`ftrun.snapshot.gf_kernels`); without
        it pyeclib computes the term from that fragment with zeros in place of the others. A relayed rebuild sums
        the terms along their holders (:mod:`ftrun.snapshot.redundancy`)."""
        length = len(into)
        problem = terms.problem(self.k, self.k + self.m) or (
            f"fragment {index} is not one of them" if index not in terms.sources else
            f"{len(piece)} bytes for {length}" if len(piece) != length else None)
        if problem is not None:
            raise ValueError(f"fragment {index}'s term of fragment {terms.want} from fragments "
                             f"{list(terms.sources)}: {problem}")
        sources = tuple(sorted(terms.sources))
        combination = self._combination(sources, terms.want)
        if combination is not None:
            combination.add(sources.index(index), piece, into)
            return
        padded = align(length)  # pyeclib codes whole multiples of ALIGN: the bytes past ``into`` are zeros
        if len(self._zeros) < padded:
            self._zeros = bytes(padded)
        zeros = memoryview(self._zeros)[:padded]
        buffers = self._terms
        if len(getattr(buffers, "term", b"")) < 2 * padded:
            buffers.term = bytearray(2 * padded)
        term, source = memoryview(buffers.term)[:padded], memoryview(buffers.term)[padded:2 * padded]
        if padded != length:
            source[length:] = zeros[length:]
            source[:length] = piece
            piece = source
        self._pyeclib({i: piece if i == index else zeros for i in sources}, terms.want, term)
        xor_into(into, term[:length])

    def _combination(self, sources: tuple[int, ...], want: int) -> Combination | None:
        """ISA-L's combination giving fragment ``want`` from the fragments ``sources`` (in that order), learned
        from pyeclib and checked against it once per codec; None: pyeclib computes it."""
        key = sources, want
        if key not in self._combinations:
            lib = load_isal()
            with self._learning:
                if key not in self._combinations:
                    zeros = bytes(len(PROBE))  # the other sources while one holds the probe

                    def term(n: int, data: Buffer) -> bytes:
                        out = bytearray(len(data))
                        self._pyeclib({i: data if i == sources[n] else zeros for i in sources}, want,
                                      memoryview(out))
                        return bytes(out)

                    self._combinations[key] = None if lib is None else Combination.learned(lib, term, len(sources))
        return self._combinations[key]

    def _reconstruct(self, pieces: Mapping[int, Buffer], want: int, into: memoryview) -> None:
        length = len(into)
        if len(pieces) != self.k or any(len(p) != length for p in pieces.values()) or length <= 0 or length % ALIGN:
            raise ValueError(f"need {self.k} pieces of {length} bytes, a multiple of {ALIGN}")
        if self.k == 1:
            into[:] = next(iter(pieces.values()))
            return
        sources = tuple(sorted(pieces))
        combination = self._combination(sources, want)
        if combination is not None:
            combination([pieces[i] for i in sources], into)
        else:
            self._pyeclib(pieces, want, into)

    def _pyeclib(self, pieces: Mapping[int, Buffer], want: int, into: memoryview) -> None:
        """Fragment ``want`` into ``into`` by pyeclib, from the k ``pieces`` (by index) of ``len(into)`` bytes, a
        multiple of :data:`ALIGN`."""
        views = {i: memoryview(piece) for i, piece in sorted(pieces.items())}
        for start in range(0, len(into), CODE_PART):
            n = min(CODE_PART, len(into) - start)
            headers = self.headers(n)
            fragments = [headers[i] + view[start:start + n] for i, view in views.items()]  # bytes, as pyeclib needs
            into[start:start + n] = memoryview(self._driver.reconstruct(fragments, [want])[0])[HEADER_BYTES:]


class CorruptFragment(ValueError):
    """A fetched parity piece does not match the checksum its holder recorded when it computed it."""


def xor_into(target: memoryview, source: Buffer) -> None:
    """``target ^= source`` (equal lengths), in numpy: no Python objects per byte, the GIL released."""
    out = np.frombuffer(target, np.uint8)
    np.bitwise_xor(out, np.frombuffer(source, np.uint8, len(out)), out=out)


def xor_fragments(k: int, chunk: int) -> list[int]:
    """The fragments of a stripe whose XOR is its data fragment ``chunk`` (XOR parity): parity k, the other data."""
    return [k] + [i for i in range(k) if i != chunk]


@dataclass(frozen=True)
class Terms:
    """Fragment ``want`` of a stripe as the XOR of the terms (:meth:`Codec.add_term`) of its ``k`` fragments
    ``sources``: how a relayed rebuild sums a chunk that XOR parity cannot give (pyeclib's reconstruction)."""

    want: int
    sources: tuple[int, ...]

    def problem(self, k: int, group: int) -> str | None:
        """Why these terms cannot rebuild a data fragment of a stripe of ``group`` fragments, ``k`` of them data
        (k distinct fragments, the wanted one a data fragment not among them); None when they can."""
        if len(self.sources) != k or len(set(self.sources)) != k or not all(0 <= i < group for i in self.sources):
            return f"need {k} distinct fragments of {group}, got {list(self.sources)}"
        if not 0 <= self.want < k or self.want in self.sources:
            return f"fragment {self.want} is not a data fragment missing from {list(self.sources)}"
        return None


@dataclass(frozen=True)
class Segment:
    """``length`` bytes at ``offset`` in a chunk, to be rebuilt straight into ``into`` (a writable view of that
    many bytes); ``into`` None: bytes past the end of the blob, not needed. A segment with ``into`` lies within
    one coding piece (:meth:`StripeLayout.pieces`), so the pieces' checksums can be checked part by part."""

    offset: int
    length: int
    into: memoryview | None


class Scratch:
    """Reusable receive buffers: two sets (a pipeline's depth) of ``count`` buffers of ``size`` bytes, allocated
    on first use and kept, so steady-state encoding and rebuilding fault in no new memory."""

    def __init__(self) -> None:
        self._sets: list[list[bytearray]] = [[], []]

    def get(self, depth: int, count: int, size: int) -> list[memoryview]:
        buffers = self._sets[depth]
        while len(buffers) < count:
            buffers.append(bytearray(size))
        for i in range(count):
            if len(buffers[i]) < size:
                buffers[i] = bytearray(size)
        return [memoryview(b)[:size] for b in buffers[:count]]


def _pipelined(pool: Executor | None, steps: Sequence[Any], start: Callable[[Any, int], list[Future[Any]]],
               finish: Callable[[Any, int], None]) -> None:
    """For each step: ``start(step, depth)`` (its fetches, as futures), then ``finish`` of the previous step while
    they run; depth alternates 0/1. A failure waits for every fetch in flight before it is raised, the step's
    started last included (none writes into a buffer after this returns); its fetches not running yet are
    cancelled."""
    pending: tuple[Any, int, list[Future[Any]]] | None = None
    started: list[Future[Any]] = []
    try:
        for n, step in enumerate(steps):
            started = start(step, n % 2)
            if pending is not None:
                _wait(pending[2])
                finish(pending[0], pending[1])
            pending = step, n % 2, started
        if pending is not None:
            _wait(pending[2])
            finish(pending[0], pending[1])
            pending = None
    finally:
        for future in started:  # the last step's, when waiting for or finishing the one before it failed
            future.cancel()
        futures_wait(started + (pending[2] if pending is not None else []))


def _wait(futures: list[Future[Any]]) -> None:
    futures_wait(futures)
    for future in futures:
        future.result()


def _submit(pool: Executor | None, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    if pool is not None:
        return pool.submit(fn, *args)
    future: Future[Any] = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # handed over like a pool's
        future.set_exception(err)
    return future


def encode_parity(codec: Codec, layout: StripeLayout, stripe: int, t: int, chunk_len: int, fetch_into: FetchInto,
                  out: memoryview, pool: Executor | None = None, scratch: Scratch | None = None,
                  also: Mapping[int, SendPiece] | None = None) -> list[int]:
    """Parity fragment ``k + t`` of ``stripe`` into ``out`` (``chunk_len`` bytes), piece by piece, pipelined;
    returns the CRC-32 of each parity piece (computed while the piece is still in cache).

    ``fetch_into(i, offset, length, into)`` fills ``into`` with bytes ``[offset, offset + length)`` of data
    fragment ``i`` of the stripe (zeros past its position's blob). XOR parity: data fragment 0 lands in ``out``
    itself and the others are XORed into it; else pyeclib computes each piece from the k data pieces.

    ``also``: for another parity index ``u`` of the same stripe, ``send(offset, piece, crc)``, called with each
    piece of fragment ``k + u`` computed from the same data pieces (a buffer reused once it returns).
    """
    crcs: list[int] = []
    scratch = scratch or Scratch()
    also = also or {}
    xor, k = codec.xor_parity(t), layout.k
    direct = xor and not also  # data fragment 0 straight into ``out`` (the data pieces are not needed after)
    pieces = layout.pieces(chunk_len)
    size = max((n for _, n in pieces), default=0)

    def start(piece: tuple[int, int], depth: int) -> list[Future[Any]]:
        offset, length = piece
        buffers = scratch.get(depth, k + len(also), size)
        targets = [out[offset:offset + length] if direct and i == 0 else buffers[i][:length] for i in range(k)]
        return [_submit(pool, fetch_into, i, offset, length, targets[i]) for i in range(k)]

    def finish(piece: tuple[int, int], depth: int) -> None:
        offset, length = piece
        buffers = scratch.get(depth, k + len(also), size)
        data = [b[:length] for b in buffers[:k]]
        target = out[offset:offset + length]
        if xor:
            if not direct:
                target[:] = data[0]
            for i in range(1, k):
                xor_into(target, data[i])
        else:
            codec.parity(data, t, target)
        crcs.append(crc32(target))
        for n, (u, send) in enumerate(also.items()):
            extra = buffers[k + n][:length]
            codec.parity(data, u, extra)
            send(offset, extra, crc32(extra))

    _pipelined(pool, pieces, start, finish)
    return crcs


def rebuild_chunk(codec: Codec, layout: StripeLayout, chunk: int, chunk_len: int, sources: Sequence[int],
                  fetch_into: FetchInto, segments: Sequence[Segment], write: Callable[[int, Buffer], None],
                  pool: Executor | None = None, scratch: Scratch | None = None,
                  parity_crcs: Mapping[int, Sequence[int]] | None = None) -> None:
    """Rebuild chunk ``chunk`` of a lost position (data fragment ``chunk`` of its stripe), pipelined.

    ``sources``: fragment indexes of the stripe whose holders survive (at least k). ``fetch_into(i, offset,
    length, into)`` fills ``into`` with those bytes of fragment ``i``. With parity fragment k and every other data
    fragment among them (m = 1, or one lost of several), the chunk is parity XOR the others, fetched straight
    into each segment's ``into``; else each piece is reconstructed from k fragments, straight into the segment
    that holds the piece whole, or else into a buffer that ``write(offset, buffer)`` stores (every byte of the
    piece, padding included; the buffer is reused once it returns). Either way a segment's memory is written only
    after ``fetch_into`` has been called for the same bytes: a caller may make it writable there.

    ``parity_crcs``: for a parity fragment index, the CRC-32 of each of its pieces, as its holder computed them;
    every piece of it that is fetched whole is checked before it is used (:class:`CorruptFragment`).
    """
    scratch = scratch or Scratch()
    k = layout.k
    pieces = layout.pieces(chunk_len)
    check = _PieceCheck(pieces, parity_crcs or {})
    others = xor_fragments(k, chunk)
    if codec.xor_first and set(others) <= set(sources):
        wanted = [s for s in segments if s.into is not None]
        size = max((s.length for s in wanted), default=0)

        def start_xor(segment: Segment, depth: int) -> list[Future[Any]]:
            buffers = scratch.get(depth, k, size)
            assert segment.into is not None
            targets = [segment.into] + [buffers[n][:segment.length] for n in range(1, k)]
            return [_submit(pool, fetch_into, i, segment.offset, segment.length, targets[n])
                    for n, i in enumerate(others)]

        def finish_xor(segment: Segment, depth: int) -> None:
            assert segment.into is not None
            check.add(k, segment.offset, segment.into)
            for buffer in scratch.get(depth, k, size)[1:]:
                xor_into(segment.into, buffer[:segment.length])

        _pipelined(pool, wanted, start_xor, finish_xor)
        return
    chosen = [i for i in sources if i != chunk][:k]
    if len(chosen) < k:
        raise ValueError(f"{len(chosen)} surviving fragments, {k} needed")
    size = max((n for _, n in pieces), default=0)
    whole = {s.offset: s.into for s in segments if s.into is not None}  # a piece one segment holds whole

    def start(piece: tuple[int, int], depth: int) -> list[Future[Any]]:
        offset, length = piece
        buffers = scratch.get(depth, k + 1, size)  # and one for the piece rebuilt
        return [_submit(pool, fetch_into, i, offset, length, buffers[n][:length])
                for n, i in enumerate(chosen)]

    def finish(piece: tuple[int, int], depth: int) -> None:
        offset, length = piece
        buffers = scratch.get(depth, k + 1, size)
        for n, i in enumerate(chosen):
            check.add(i, offset, buffers[n][:length])
        into = whole.get(offset)
        direct = into is not None and len(into) == length  # its bytes writable: fetched (see above)
        target = into if direct else buffers[k][:length]
        codec.reconstruct({i: buffers[n][:length] for n, i in enumerate(chosen)}, chunk, target)
        if not direct:
            write(offset, target)

    _pipelined(pool, pieces, start, finish)


class _PieceCheck:
    """CRC-32 checks of parity pieces received in consecutive parts (a piece may arrive as several segments)."""

    def __init__(self, pieces: Sequence[tuple[int, int]], crcs: Mapping[int, Sequence[int]]) -> None:
        self.pieces, self.crcs = pieces, crcs
        self.running: dict[tuple[int, int], tuple[int, int]] = {}  # (fragment, piece) -> (crc so far, bytes)

    def add(self, fragment: int, offset: int, data: Buffer) -> None:
        expected = self.crcs.get(fragment)
        if expected is None or not data:
            return
        piece = next(p for p, (o, n) in enumerate(self.pieces) if o <= offset < o + n)
        start, length = self.pieces[piece]
        crc, got = self.running.get((fragment, piece), (0, 0))
        if offset != start + got:
            return  # not the next bytes of the piece (a part past the blob was skipped): left to the image's check
        crc, got = crc32(data, crc), got + len(data)
        self.running[fragment, piece] = crc, got
        if got == length and piece < len(expected) and crc != expected[piece]:
            raise CorruptFragment(f"parity fragment {fragment}, piece {piece} (bytes {start}..{start + length}) "
                                  f"fails its checksum ({crc:08x}, recorded {expected[piece]:08x})")
