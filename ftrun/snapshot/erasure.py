"""Erasure-coded redundancy of the nodes of an EC group: the rotated stripe layout and the pyeclib codec.

A job's nodes form groups of ``G`` consecutive node ranks (node ``r`` is position ``r % G`` of group ``r // G``)
with ``m`` parity, ``k = G - m``. At a step, every node's *blob* (its ranks' slot images, one after the other) is
cut into ``k`` chunks of ``L`` bytes, ``L`` the same for the whole group (the largest blob over ``k``, rounded up
to :data:`ALIGN`; a short blob is padded with zeros). There are ``G`` stripes::

    stripe j:  data fragment i (i < k)  = chunk i of position (j + m + i) % G
               parity fragment k + t    held by position (j + t) % G            (t < m)

so parity rotates like RAID-6: every position holds its own blob, parity for ``m`` stripes (``m/k`` of a blob),
and is a data node of the other ``k``; chunk ``c`` of position ``p`` is data fragment ``c`` of stripe
``(p - m - c) % G``. Any ``m`` lost positions leave ``k`` fragments in every stripe, which rebuild the rest.

Fragments are coded in *pieces* of at most :data:`PIECE` bytes (pyeclib segfaults on inputs over 2 GiB and
returns fresh bytes, so bounded pieces also bound memory). pyeclib's Reed-Solomon codes are systematic: a data
fragment's payload is the data piece itself; every fragment carries an 80-byte header that decoding needs, so
the holder of parity keeps the headers of every fragment of its stripes (:meth:`Codec.encode`).

This module is pure computation (no I/O, no torch): the keeper feeds it bytes it fetched from peers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from pyeclib.ec_iface import ECDriver

ALIGN = 4096
PIECE = 64 << 20
HEADER_BYTES = 80
DEFAULT_BACKEND = "isa_l_rs_vand"
BACKENDS = ("isa_l_rs_vand", "isa_l_rs_cauchy", "liberasurecode_rs_vand")
MAX_DEFAULT_GROUP = 4

Buffer = bytes | bytearray | memoryview
FetchChunk = Callable[[int, int, int, int], Buffer]  # (position, chunk, offset, length) -> those bytes
FetchFragment = Callable[[int, int, int], Buffer]  # (fragment index, offset, length) -> those bytes
Mapper = Callable[[Callable[[int], Buffer], Iterable[int]], Iterable[Buffer]]  # map, or a thread pool's map


def default_group(nnodes: int) -> tuple[int, int]:
    """(G, m) when the user gave neither: no redundancy on one node, else m = 1 in groups of up to 4 nodes.

    G is the largest divisor of ``nnodes`` in 2..4; a prime node count above 4 forms one group of all nodes.
    """
    if nnodes < 2:
        return 1, 0
    group = max((g for g in range(2, MAX_DEFAULT_GROUP + 1) if nnodes % g == 0), default=nnodes)
    return group, 1


def group_problem(nnodes: int, group: int, parity: int, backend: str) -> str | None:
    """Why (G, m, backend) cannot protect ``nnodes`` nodes, in one line; None when it can."""
    if group < 1 or parity < 0:
        return f"--ec-group must be >= 1 and --ec-parity >= 0, got {group} and {parity}"
    if parity == 0:
        return None
    if parity >= group:
        return f"--ec-parity {parity} must be smaller than --ec-group {group} (at least one data node per group)"
    if group > nnodes:
        return f"--ec-group {group} is larger than --nnodes {nnodes}"
    if nnodes % group:
        return f"--nnodes {nnodes} cannot be divided into groups of --ec-group {group}"
    if backend not in BACKENDS:
        return f"--ec-backend {backend!r} is not available (available: {', '.join(BACKENDS)})"
    return None


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

    def pieces(self, chunk_len: int) -> list[tuple[int, int]]:
        """(offset, length) of the coding pieces of a fragment of ``chunk_len`` bytes."""
        piece = max(ALIGN, min(self.piece, (1 << 30) // self.group) // ALIGN * ALIGN)
        return [(o, min(piece, chunk_len - o)) for o in range(0, chunk_len, piece)]


class Codec:
    """pyeclib Reed-Solomon over one stripe's pieces: ``k`` data pieces of equal, aligned length.

    With ``k = 1`` (replication) every parity fragment of a Reed-Solomon code is the data piece itself up to a
    scale factor; this codec makes it exactly the piece and skips pyeclib (a copy instead of an encode), and
    reconstructs from any one fragment.
    """

    def __init__(self, k: int, m: int, backend: str = DEFAULT_BACKEND) -> None:
        self.k, self.m, self.backend = k, m, backend

    @cached_property
    def _driver(self) -> ECDriver:
        return ECDriver(k=self.k, m=self.m, ec_type=self.backend)

    def encode(self, pieces: Sequence[Buffer]) -> tuple[list[Buffer], list[bytes]]:
        """(the m parity payloads, the k + m fragment headers: none for k = 1) of one piece of a stripe."""
        if len(pieces) != self.k or len({len(p) for p in pieces}) != 1 or len(pieces[0]) % ALIGN:
            raise ValueError(f"need {self.k} pieces of one length, a multiple of {ALIGN}")
        if self.k == 1:
            return [pieces[0]] * self.m, []
        fragments = self._driver.encode(b"".join(pieces))  # pyeclib takes bytes only
        size = len(pieces[0])
        if any(len(f) != HEADER_BYTES + size for f in fragments):
            raise RuntimeError(f"{self.backend}: unexpected fragment size (not systematic on aligned pieces)")
        return [memoryview(f)[HEADER_BYTES:] for f in fragments[self.k:]], [f[:HEADER_BYTES] for f in fragments]

    def reconstruct(self, available: Mapping[int, Buffer], headers: Sequence[bytes], want: int) -> Buffer:
        """The payload of fragment ``want`` from ``k`` or more other fragments' payloads and every header."""
        if len(available) < self.k:
            raise ValueError(f"{len(available)} fragments available, {self.k} needed")
        chosen = sorted(available)[:self.k]
        if self.k == 1:
            return available[chosen[0]]
        if len(headers) != self.k + self.m or any(len(h) != HEADER_BYTES for h in headers):
            raise ValueError("fragment headers missing or malformed")
        # pyeclib aborts the process on anything but bytes here: header + payload as one bytes object each
        fragments = [bytes(headers[i]) + available[i] for i in chosen]
        return memoryview(self._driver.reconstruct(fragments, [want])[0])[HEADER_BYTES:]


def encode_stripe(codec: Codec, layout: StripeLayout, stripe: int, chunk_len: int, t: int, fetch: FetchChunk,
                  mapper: Mapper = map) -> Iterator[tuple[int, Buffer, list[bytes]]]:
    """Parity fragment ``k + t`` of ``stripe``, piece by piece: (offset, parity payload, fragment headers).

    ``fetch(position, chunk, offset, length)`` returns those bytes of that position's chunk (zeros past its blob);
    the k fetches of a piece go through ``mapper`` (a thread pool's ``map`` fetches them in parallel).
    """
    for offset, length in layout.pieces(chunk_len):
        data = list(mapper(lambda i: fetch(layout.data_position(stripe, i), i, offset, length), range(layout.k)))
        parity, headers = codec.encode(data)
        yield offset, parity[t], headers


def rebuild_chunk(codec: Codec, layout: StripeLayout, chunk: int, chunk_len: int, sources: Sequence[int],
                  fetch_fragment: FetchFragment, headers: Sequence[Sequence[bytes]],
                  mapper: Mapper = map) -> Iterator[tuple[int, Buffer]]:
    """Chunk ``chunk`` of a lost position (data fragment ``chunk`` of its stripe), piece by piece: (offset, bytes).

    ``sources``: fragment indexes of the stripe whose holders survive (at least k); the first k are read.
    ``fetch_fragment(index, offset, length)`` returns those bytes of that fragment; ``headers[piece]`` are that
    piece's k + m fragment headers.
    """
    chosen = [i for i in sources if i != chunk][:layout.k]
    if len(chosen) < layout.k:
        raise ValueError(f"{len(chosen)} surviving fragments, {layout.k} needed")
    for piece, (offset, length) in enumerate(layout.pieces(chunk_len)):
        got = list(mapper(lambda i: fetch_fragment(i, offset, length), chosen))
        yield offset, codec.reconstruct(dict(zip(chosen, got)), headers[piece], chunk)
