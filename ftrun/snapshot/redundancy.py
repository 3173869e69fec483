"""The keeper's erasure-coded redundancy: parity for its EC group, served to peers, and rebuilds of lost nodes.

Runs inside the keeper (no torch). The layout is :mod:`ftrun.snapshot.erasure`'s; bytes move between keepers
over :mod:`ftrun.snapshot.transport` (authenticated TCP; slot and parity bytes are sent from their files).

*Blob* of a node at step s: for each local rank in order, the image of its slot holding s (header page and
payload, ``HEADER_SIZE + payload_len`` bytes). A blob is only served once every image is sealed (checksummed by
the keeper), so a rebuilt image carries its checksum and is verified like any slot before it is used.

*Parity files* ``ftrun-<job>-node<N>-parity<I>`` (I = 0, 1; the slot file format of :mod:`ftrun.snapshot.slot`):
the payload holds this node's ``m`` parity fragments of step s (fragment ``k + t`` of stripe
``parity_stripes[t]`` at ``t * L``), then JSON: the group's shape, this node's position, ``L``, the piece size,
every position's image lengths and checksums, and the CRC-32 of every parity piece, which the file's seal folds
(:func:`parity_checksum`): a rebuild checks each parity piece it fetches whole against it, and a keeper that
adopts the file checks them all. A parity file is committed only after every data node still holds the same
images as when the encoding started.

Data moves without extra copies: an encoder receives (``recv_into``) the first data fragment of an XOR stripe
straight into its parity file and XORs the others into it; a rebuild receives the parity fragment straight into
the new slot files and XORs the surviving data fragments into them (:mod:`ftrun.snapshot.erasure`). The new
slots' memory is allocated by a thread of its own ahead of the transfer
(:class:`ftrun.snapshot.slot.AheadAllocator`): allocating /dev/shm pages costs about as much as receiving their
bytes, and the two overlap.

A rebuild is *relayed* through the survivors. Each chunk of the lost node is the XOR of the k other fragments
of its stripe (XOR parity: m = 1, or one lost of several with ``*_rs_vand``), or else the XOR of the *terms* of
k surviving fragments in pyeclib's reconstruction (two lost of a stripe, or Cauchy parity; reconstruction is
linear, so a holder computes its term from its own fragment alone: :meth:`~ftrun.snapshot.erasure.Codec.add_term`).
Instead of receiving all k fragments (k x the lost bytes through its NIC), the replacement asks the first holder
of a chain for the sum (``xor``): each holder asks the next one for the sum of the rest, adds its own fragment
(or term) and answers, and the last one answers with its fragment (or term). The replacement receives each byte
once, straight into its slots, and every holder sends about one blob's worth per lost node (the chains of the
k chunks start at different survivors), so on a cluster whose NICs limit a rebuild it takes about as long as
copying the blob (repair pipelining, as in ECPipe). With two data fragments of a stripe lost, chains would make
every survivor send one blob's worth per lost node; instead a chunk is *decoded* by its sources in turn
(``decode``): for each cell of :data:`RELAY_PART` bytes, one source (the same for every replacement, a different
one for the next cell) fetches the other k - 1 sources' bytes of the cell, computes every lost data fragment's
bytes from them, answers with the one asked for and keeps the others until their replacements ask
(:mod:`ftrun.snapshot.decoded`). Each survivor then sends (k + 1) / k of a chunk per such stripe instead of 2:
k = 4, m = 2, two of six lost: 5.75 to 6.5 chunks instead of 8. When every survivor is on the replacement's
host (no NIC in the way), the rebuild is direct instead: there the relay's hops are CPU copies, not NIC time, and
a relay keeps the survivors' keepers busy (receive, XOR, send) while they restart their own trainers.
A holder checks each whole parity piece it reads against its CRC-32; a relay that fails (a corrupt piece, a
survivor answering with an error, a rebuilt image that fails its checksum) is done again directly, every
fragment fetched by the replacement, which checks what it receives and reports the fragment at fault.

Encoding follows the job: when the newest globally committed step (told by the supervisor's link) has no
parity here, the encoder fetches the data fragments of this node's stripes from the other nodes of the group,
piece by piece, and writes parity into the parity file that does not hold the job's protected step (the
newest step every rank holds with complete parity everywhere; the link tells it too), then allocates the other
parity file if it is empty, so that only the first encode waits for parity pages. Since trainers only
overwrite a slot once the newer one is protected, the data of the step being encoded stays in place.

With m >= 2 (and k >= 2) a stripe's data is fetched once, not m times: position p computes every parity
fragment of its stripe p from the same data pieces, keeps fragment k, and *pushes* each piece of fragment
k + t to the stripe's holder of it, position p + t (``parity_put``, the piece's CRC-32 with it), which receives
it straight into its parity file. Once p has checked that the data did not change while it read it, it tells
each holder so (``parity_put_end``, with the image checksums it read). The holder uses pushed parity only if
every piece arrived with its CRC and the sender read the same images as it did; else (a sender lost, late,
still on another step, or no push within :data:`PUSH_IDLE` seconds) it fetches that stripe's data and computes
the fragment itself, as with m = 1. A holder expects pushes before it allocates its parity file; a piece that
comes meanwhile waits for the memory. An encode moves (1 + (m - 1)/k) x the node's state instead of m x.

Peer requests (JSON; payloads are raw bytes): ``info {step}`` -> image lengths and checksums (of a slot still
being checksummed once sealed, within :data:`SEAL_WAIT`), and whether this
keeper holds parity of the step already (then it pushes none: its holders do not wait for it);
``chunk {step, chunk, offset, length, chunk_len}`` -> bytes of a chunk of the blob (zeros past its end);
``parity_meta {step}`` -> the parity file's JSON; ``parity {step, t, offset, length}`` -> parity bytes;
``xor {step, stripe, parts, chunk_len, offset, length[, want, sources]}`` -> the XOR of those bytes of fragments
``parts`` of ``stripe`` (parts[0] this node's; relayed), or of their terms in the reconstruction of fragment
``want`` from ``sources``; ``decode {step, stripe, want, sources, others, chunk_len, offset, length}`` -> those
bytes of fragment ``want`` reconstructed from ``sources`` (this node's one of them), fragments ``others``
decoded alongside and kept; ``parity_put {step, t, offset, chunk_len, crc}`` + a parity piece;
``parity_put_end {step, t, infos}``. A rebuild's requests carry ``rebuild`` and go over connections of their
own: a thread that served an encoder's ``chunk`` runs in ``SCHED_IDLE`` from then on (encoding is background
work), and none of those serves a rebuild, which the whole job waits for.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from isal.isal_zlib import crc32

from ftrun.events import EventLog
from ftrun.snapshot.decoded import DecodedPieces
from ftrun.snapshot.priority import lower_to_background
from ftrun.snapshot.erasure import (Buffer, Codec, CorruptFragment, Scratch, Segment, SendPiece, StripeLayout, Terms,
                                    encode_parity, rebuild_chunk, xor_fragments, xor_into)
from ftrun.snapshot.slot import COMMITTED, EMPTY, HEADER_SIZE, WRITING, AheadAllocator, Header, SlotFile
from ftrun.snapshot.transport import FileRange, PeerError, PeerPool, PeerServer, PeerUnavailable, Reply


class HeldSlots(Protocol):
    """One local rank's slots as the keeper holds them: the files and the committed step in each."""

    files: list[SlotFile | None]
    steps: list[int | None]


class SlotHolder(Protocol):
    """What redundancy needs of the keeper (:class:`ftrun.snapshot.keeper.Keeper`), so that neither module
    imports the other: where the segments are, its lock and events, its ranks' slots, and a way to pin a slot
    it rebuilt."""

    dir: str
    job: str
    generation: int
    cond: threading.Condition
    events: EventLog
    ranks: Sequence[HeldSlots]

    def claim_vacant(self, local: int, image: int, allocate: bool = True) -> tuple[int, SlotFile]: ...

    def hold_restored(self, local: int, index: int, step: int) -> None: ...

PARITY_FILES = 2
META_ROOM = 64 << 10
PUSH_WAIT = 1.0  # seconds a pushed piece waits for this keeper to start encoding its step
PUSH_IDLE = 3.0  # seconds without a pushed piece or end before a holder computes the missing parity itself
PUSH_POLL = 0.05  # seconds between two looks at the generation while pushes are awaited
# bytes of a relayed request: each holder of a chain receives a part whole before it sends its sum on, so small
# parts keep every link busy, down to where the cost per request shows. x the TCP copy, benchmarks/network.py (NICs
# of 1 Gbit/s, 128 MiB per rank): k=2 m=1 1 MiB 1.11, 256 KiB 1.04; k=4 m=2 two lost 1 MiB 2.85-3.05, 256 KiB
# 2.49-2.61, 128 KiB 2.89 (measured before terms were ISA-L's; since, 1 MiB 2.40-2.53, 256 KiB 2.65-2.78: each hop
# computes a term per part)
RELAY_PART = 1 << 20  # terms; the most a relay request may ask for
RELAY_PART_NIC = 256 << 10  # XOR chains
DECODED_BUDGET = 64 << 20  # bytes of pieces a survivor keeps for another replacement of a joint rebuild
SEAL_WAIT = 1.0  # seconds an encoder's ``info`` waits for a committed slot's checksum (the keeper seals at idle)
REBUILD_IDLE_CONNECTIONS = 2  # idle connections per peer kept after a rebuild (rare; an encoder's pool keeps 4)
PEER_TIMEOUT = 30.0  # seconds without progress on a request to a peer (the keeper sets it from --node-timeout)
REJECT_NOTICE = 60.0  # seconds between two console lines about peer connections refused or ended by a fault
REJECT_LOGGED = 100  # such connections written to the event log per REJECT_NOTICE seconds, at most


class RedundancyError(RuntimeError):
    """A rebuild or an encoding could not complete (a peer gone, data changed under it, a bad image)."""


def parity_name(job: str, node: int | str, index: int | str) -> str:
    return f"ftrun-{job}-node{node}-parity{index}"


@dataclass(frozen=True)
class GroupPlace:
    """This node's place in its EC group."""

    node: int
    group: int  # G
    parity: int  # m
    backend: str

    @property
    def position(self) -> int:
        return self.node % self.group

    @property
    def base(self) -> int:
        """Node rank of position 0 of this node's group."""
        return self.node - self.position

    @property
    def index(self) -> int:
        """The group's number."""
        return self.node // self.group


@dataclass
class _Incoming:
    """Parity fragments of one step that the other positions push to this keeper while it encodes (module doc):
    for each pushed t, the CRC-32 of every piece received whole and checked, and the images the sender read."""

    step: int
    chunk_len: int
    pieces: list[tuple[int, int]]
    crcs: dict[int, dict[int, int]]  # t -> piece offset -> CRC-32
    ended: dict[int, Any]  # t -> the images the sender read (its ``infos``)
    payload: memoryview | None = None  # the parity file's payload (fragment k + t at t * chunk_len) once allocated
    receiving: int = 0  # pieces being received now
    last: float = 0.0  # monotonic time of the last piece or end
    closed: bool = False

    def complete(self, t: int, infos: Any) -> bool:
        return len(self.crcs[t]) == len(self.pieces) and self.ended.get(t) == infos


@dataclass
class _CheckedParity:
    """The pieces of the parity file content ``key`` (path, step, seal), their recorded CRC-32s by stripe, and
    the (t, piece) found good so far."""

    key: tuple[str, int, int] | None
    pieces: list[tuple[int, int]]
    crcs: dict[str, list[int]]
    good: set[tuple[int, int]]


class Redundancy:
    """Parity encoding, peer serving and rebuilds of one keeper; see the module doc."""

    def __init__(self, keeper: SlotHolder, place: GroupPlace, secret: bytes, listener: socket.socket,
                 peer_timeout: float = PEER_TIMEOUT) -> None:
        self.keeper = keeper
        self.place = place
        self.layout = StripeLayout(place.group, place.parity)
        self.codec = Codec(self.layout.k, place.parity, place.backend)
        self.files: list[SlotFile | None] = [None] * PARITY_FILES
        self.steps: list[int | None] = [None] * PARITY_FILES  # complete parity held per file
        self.wanted = 0  # bytes of the parity file made last (or tried: see _ensure)
        self._rejected_shown = -REJECT_NOTICE  # when the last refused connection was printed (see _rejected)
        self._rejected_quiet = 0  # refused connections not printed since
        self._rejected_logged = 0  # refused connections in the event log since
        self.peers: dict[int, str] = {}  # node -> "host:port"
        self._connections = PeerPool(secret, peer_timeout)
        # a rebuild's requests on connections of their own: a peer's thread that served an encoder runs in
        # SCHED_IDLE for good (serve), and a rebuild, which every trainer waits for, must not wait for idle cores
        self._rebuild_connections = PeerPool(secret, peer_timeout, idle=REBUILD_IDLE_CONNECTIONS)
        # two pieces in flight (erasure's pipeline), k fetches each; encoding is background work, a rebuild is not
        self._pool = ThreadPoolExecutor(2 * max(place.group, 1), thread_name_prefix="ftrun-rebuild-fetch")
        self._encode_pool = ThreadPoolExecutor(2 * max(place.group, 1), thread_name_prefix="ftrun-encode-fetch",
                                               initializer=lower_to_background)
        self._scratch, self._encode_scratch = Scratch(), Scratch()
        self.phases: dict[str, float] = {}  # seconds of the parts of the last encode or rebuild (events)
        self.allocated_ahead = 0  # bytes of the last rebuild's slots allocated before it began (prepare)
        self._prepared: _BlobWriter | None = None  # slots being allocated for a rebuild not asked for yet
        self._prepared_lock = threading.Lock()
        self._checked = _CheckedParity(None, [], {}, set())  # parity pieces checked for relays and rebuilds
        self._relay_buffers = threading.local()  # a relaying thread's copy of its own fragment (_add_own)
        self._decoded = DecodedPieces(DECODED_BUDGET)  # cells decoded for the replacements of a joint rebuild
        self.relayed = False  # whether the last rebuild was relayed through the survivors (module doc)
        self.decoded = False  # whether some of its chunks were decoded by the survivors with another lost one's
        self.serving_rebuild: Callable[[int], None] = lambda step: None  # told each piece served to a rebuild
        self.pushing = place.parity > 1 and self.layout.k > 1  # stripes' other parity pushed (module doc)
        self._incoming: _Incoming | None = None
        self._pushes = threading.Condition()
        self.server = PeerServer(secret, self.serve, listener=listener, on_event=self._rejected,
                                 max_payload=self.layout.piece_len if self.pushing else 0, sink=self._receive_push,
                                 timeout=peer_timeout)

    @property
    def peer_timeout(self) -> float:
        """Seconds a peer may leave a request without progress (then: lost)."""
        return self._connections.timeout

    # -- files ------------------------------------------------------------------------------------------------
    def path(self, index: int) -> str:
        return os.path.join(self.keeper.dir, parity_name(self.keeper.job, self.place.node, index))

    def adopt(self) -> list[str]:
        """Keep the valid parity files a previous keeper of this node left; returns what was kept/dropped."""
        notes = []
        for index in range(PARITY_FILES):
            if not os.path.exists(self.path(index)):
                continue
            try:
                file = SlotFile(self.path(index))
            except (OSError, ValueError) as err:
                notes.append(f"parity {index}: {err}")
                continue
            self.files[index] = file
            if file.header().state in (EMPTY, WRITING):
                continue
            problem = file.problem() or parity_problem(file)
            if problem is None:
                self.steps[index] = file.header().step
                notes.append(f"parity {index} step {file.header().step}")
            else:
                file.set_state(EMPTY)
                notes.append(f"parity {index} dropped: {problem}")
        return notes

    def drop_newer(self, step: int) -> None:
        """Drop the parity of steps newer than ``step``, a new generation's plan, which discards those steps' slots
        (caller holds the keeper's lock). It was computed from a future that did not happen for every rank: kept,
        the step would count as protected once the generation commits it anew, and a rebuild would give back the
        old generation's bytes."""
        for index, held in enumerate(self.steps):
            if held is not None and held > step:
                self.steps[index] = None
                if (file := self.files[index]) is not None:
                    file.set_state(EMPTY)

    def held(self) -> list[int]:
        with self.keeper.cond:
            return sorted(s for s in self.steps if s is not None)

    def close(self) -> None:
        self.drop_prepared()
        self._pool.shutdown(wait=False)
        self._encode_pool.shutdown(wait=False)
        self.server.close()
        self._connections.close()
        self._rebuild_connections.close()
        for file in self.files:
            if file is not None:
                file.close()

    # -- serving peers ----------------------------------------------------------------------------------------
    def _rejected(self, message: str) -> None:
        """One console line per :data:`REJECT_NOTICE` seconds (a scan or a flood of stalled connections would
        print one per connection), which counts the others; the first :data:`REJECT_LOGGED` of those seconds in the
        event log (a flood would grow it without bound)."""
        now = time.monotonic()
        shown = now - self._rejected_shown >= REJECT_NOTICE
        more = f" ({self._rejected_quiet} more since the last such line)" if shown and self._rejected_quiet else ""
        if shown:
            self._rejected_shown, self._rejected_quiet, self._rejected_logged = now, 0, 0
        else:
            self._rejected_quiet += 1
        if self._rejected_logged >= REJECT_LOGGED:
            return
        self._rejected_logged += 1
        self.keeper.events.emit("peer_rejected", f"{message}{more}", console=shown, node=self.place.node)

    def serve(self, request: dict[str, Any]) -> Reply:
        op = request.get("op")
        step = int(request["step"])
        if op in ("parity_put", "parity_put_end"):
            return self._pushed(op, step, request)
        if op == "info":
            images = self._images(step, wait=SEAL_WAIT)
            with self.keeper.cond:
                held = step in self.steps  # parity of it already here: this keeper will not push any of it
            return Reply({"images": [len_ for _, len_, _ in images], "crcs": [crc for _, _, crc in images],
                          "parity": held})
        if request.get("rebuild"):
            self.serving_rebuild(step)
        elif op == "chunk":
            lower_to_background()  # this connection serves an encoder (its own thread, lowered for good)
        if op == "chunk":
            return Reply({}, self._blob_ranges(step, int(request["chunk"]) * int(request["chunk_len"])
                                               + int(request["offset"]), int(request["length"])))
        if op == "xor":
            return Reply({}, self._relay(step, request))
        if op == "decode":
            return Reply({}, self._decode(step, request))
        if op == "parity_meta":
            file = self.files[self._parity_index(step)]
            assert file is not None
            header = file.header()
            return Reply({}, bytes(file.payload()[header.data_len:header.payload_len]))
        if op == "parity":
            file, at = self._parity_range(step, int(request["t"]), int(request["offset"]), int(request["length"]),
                                          checked=bool(request.get("rebuild")))
            return Reply({}, [FileRange(file.path, HEADER_SIZE + at, int(request["length"]))])
        raise ValueError(f"unknown op {op!r}")

    def _images(self, step: int, wait: float = 0.0) -> list[tuple[str, int, int]]:
        """(path, image length, checksum) of every local rank's sealed slot of ``step``."""
        return [(file.path, size, crc) for file, size, crc in self._image_files(step, wait)]

    def _image_files(self, step: int, wait: float = 0.0) -> list[tuple[SlotFile, int, int]]:
        """(slot file, image length, checksum) of every local rank's sealed slot of ``step``; a slot committed
        but still being checksummed is waited for up to ``wait`` seconds (then LookupError, as for one not held)."""
        deadline = time.monotonic() + wait
        with self.keeper.cond:
            while True:
                images, unsealed = [], None
                for local, rank in enumerate(self.keeper.ranks):
                    index = next((i for i, s in enumerate(rank.steps) if s == step), None)
                    file = rank.files[index] if index is not None else None
                    if file is None:
                        raise LookupError(f"step {step} not held by local rank {local}")
                    header = file.header()
                    if header.state != COMMITTED or not header.sealed or header.step != step:
                        unsealed = local
                        break
                    images.append((file, HEADER_SIZE + header.payload_len, header.checksum))
                if unsealed is None:
                    return images
                if header.state != COMMITTED or header.step != step or not self.keeper.cond.wait(
                        max(0.0, deadline - time.monotonic())):
                    raise LookupError(f"step {step} of local rank {unsealed} not sealed yet")

    def _blob_ranges(self, step: int, offset: int, length: int) -> list[FileRange | bytes]:
        """The bytes [offset, offset + length) of this node's blob of ``step`` as file ranges (zeros past it)."""
        pieces: list[FileRange | bytes] = []
        start = 0
        end = offset + length
        for path, size, _ in self._images(step):
            lo, hi = max(offset, start), min(end, start + size)
            if lo < hi:
                pieces.append(FileRange(path, lo - start, hi - lo))
            start += size
        covered = sum(p.length for p in pieces if isinstance(p, FileRange))
        if covered < length:
            pieces.append(bytes(length - covered))
        return pieces

    def _parity_index(self, step: int) -> int:
        with self.keeper.cond:
            for index, held in enumerate(self.steps):
                if held == step:
                    return index
        raise LookupError(f"no parity of step {step} on node {self.place.node}")

    # -- relayed rebuilds (module doc) ----------------------------------------------------------------------------
    def _relay(self, step: int, request: dict[str, Any]) -> bytearray:
        """The answer to ``xor``: bytes ``[offset, offset + length)`` of the XOR of fragments ``parts`` of
        ``stripe`` (data fragments and XOR parity k), parts[0] this node's: what the holder of parts[1] answers
        for the rest, with this node's fragment XORed in. With ``want`` and ``sources`` (:class:`Terms`), of
        their terms in the reconstruction of fragment ``want`` from ``sources`` instead (one part: this node's
        term alone)."""
        layout = self.layout
        stripe, chunk_len = int(request["stripe"]), int(request["chunk_len"])
        offset, length = int(request["offset"]), int(request["length"])
        parts = [int(i) for i in request["parts"]]
        terms = None
        if request.get("sources") is not None:
            terms = Terms(int(request["want"]), tuple(int(i) for i in request["sources"]))
        if not (0 <= stripe < layout.group and len(parts) == len(set(parts)) >= (1 if terms else 2)
                and (set(parts) <= set(terms.sources) if terms else all(0 <= i <= layout.k for i in parts))
                and (terms is None or terms.problem(layout.k, layout.group) is None)
                and layout.position(stripe, parts[0]) == self.place.position
                and 0 < length <= RELAY_PART and 0 <= offset and offset + length <= chunk_len):
            raise ValueError(f"bad xor request for stripe {stripe}, fragments {parts}, bytes {offset}+{length}")
        for node, address in dict(request.get("peers") or {}).items():  # what its link has not told it yet
            self.peers.setdefault(int(node), str(address))
        out = bytearray(length)
        view = memoryview(out)
        if len(parts) > 1:
            self._fetch_fragments(step, stripe, parts[1:], chunk_len, offset, view, terms)
        self._add_own(step, parts[0], chunk_len, offset, view, terms)
        return out

    def _decode(self, step: int, request: dict[str, Any]) -> bytes:
        """The answer to ``decode``: bytes ``[offset, offset + length)`` of data fragment ``want`` of ``stripe``,
        reconstructed here from fragments ``sources`` (this node's among them) in the cell of :data:`RELAY_PART`
        bytes that holds them; the cell of every fragment in ``others`` (lost too) is computed from the same bytes
        and kept for its replacement (:class:`~ftrun.snapshot.decoded.DecodedPieces`; module doc)."""
        layout = self.layout
        stripe, chunk_len = int(request["stripe"]), int(request["chunk_len"])
        offset, length = int(request["offset"]), int(request["length"])
        sources = tuple(int(i) for i in request["sources"])
        wants = [int(request["want"]), *(int(i) for i in request.get("others") or [])]
        start = offset - offset % RELAY_PART
        own = next((i for i in sources if 0 <= stripe < layout.group and 0 <= i < layout.group
                    and layout.position(stripe, i) == self.place.position), None)
        if not (own is not None and len(set(wants)) == len(wants) <= layout.group - layout.k
                and all(Terms(w, sources).problem(layout.k, layout.group) is None for w in wants)
                and 0 < length and 0 <= offset and offset + length <= min(start + RELAY_PART, chunk_len)):
            raise ValueError(f"bad decode request for stripe {stripe}, fragments {wants} from {list(sources)}, "
                             f"bytes {offset}+{length}")
        for node, address in dict(request.get("peers") or {}).items():  # what its link has not told it yet
            self.peers.setdefault(int(node), str(address))
        cell = min(RELAY_PART, chunk_len - start)

        def compute() -> dict[int, bytearray]:
            fragments = {index: memoryview(bytearray(cell)) for index in sources}
            fetches = [self._pool.submit(self._fetch_fragments, step, stripe, [index], chunk_len, start, into)
                       for index, into in fragments.items() if index != own]  # all at once, not one after the other
            try:
                self._own_fragment(step, own, chunk_len, start, fragments[own], _copy)  # zeros past the blob
                for fetch in fetches:
                    fetch.result()
            finally:
                futures_wait(fetches)  # none writes into the fragments after this returns
            pieces = {want: bytearray(cell) for want in wants}
            for index, fragment in fragments.items():
                for want in wants:
                    self.codec.add_term(Terms(want, sources), index, fragment, memoryview(pieces[want]))
            return pieces

        key = (step, stripe, chunk_len, start, sources, tuple(sorted(wants)))
        return self._decoded.take(key, wants[0], offset - start, length, compute)

    def _fetch_fragments(self, step: int, stripe: int, parts: list[int], chunk_len: int, offset: int,
                         into: memoryview, terms: Terms | None = None) -> None:
        """Fill ``into`` with bytes from ``offset`` of fragment ``parts[0]`` of ``stripe``, from its holder; with
        several parts (or ``terms``), of the XOR of those fragments (or of their terms), relayed along their
        holders in order. A holder further down the chain that did not answer is :class:`PeerUnavailable` here
        too (a lost survivor, not a bad relay). A relay request carries the addresses of the holders after the first
        that this node knows: a survivor whose keeper was restarted knows none until its link tells it again."""
        k = self.layout.k
        node = self._node(self.layout.position(stripe, parts[0]))
        fields: dict[str, Any] = {"step": step, "offset": offset, "length": len(into), "rebuild": True}
        if len(parts) > 1 or terms is not None:
            after = (self._node(self.layout.position(stripe, i)) for i in parts[1:])
            fields["peers"] = {str(n): self.peers[n] for n in after if n in self.peers}
            if terms is not None:
                fields.update(want=terms.want, sources=list(terms.sources))
            self._ask_relay(node, "xor", into, stripe=stripe, parts=parts, chunk_len=chunk_len, **fields)
        elif parts[0] < k:
            self._fetch_into(node, "chunk", into, chunk=parts[0], chunk_len=chunk_len, **fields)
        else:
            self._fetch_into(node, "parity", into, t=parts[0] - k, **fields)

    def _fetch_decoded(self, step: int, stripe: int, terms: Terms, others: tuple[int, ...], chunk_len: int,
                       offset: int, into: memoryview) -> None:
        """Fill ``into`` with bytes from ``offset`` of data fragment ``terms.want`` of ``stripe``, decoded by the
        holder of one of ``terms.sources``, which decodes the lost fragments ``others`` with it (``decode``).
        The holder is the same for every replacement of a cell, and each source holds the cells in turn."""
        layout = self.layout
        decoder = terms.sources[(offset // RELAY_PART + stripe) % layout.k]
        node = self._node(layout.position(stripe, decoder))
        around = (self._node(layout.position(stripe, i)) for i in terms.sources if i != decoder)
        self._ask_relay(node, "decode", into, step=step, stripe=stripe, chunk_len=chunk_len, offset=offset,
                        length=len(into), want=terms.want, sources=list(terms.sources), others=list(others),
                        peers={str(n): self.peers[n] for n in around if n in self.peers}, rebuild=True)

    def _ask_relay(self, node: int, op: str, into: memoryview, **fields: Any) -> None:
        """``_fetch_into`` for a request that ``node`` answers with what it fetched from others: a holder behind
        it that did not answer is :class:`PeerUnavailable` here too (a lost survivor, not a bad answer)."""
        try:
            self._fetch_into(node, op, into, **fields)
        except PeerError as err:
            if str(err).startswith(f"{PeerUnavailable.__name__}:"):
                raise PeerUnavailable(f"node {node} relayed: {err}") from err
            raise

    def _add_own(self, step: int, index: int, chunk_len: int, offset: int, into: memoryview,
                 terms: Terms | None) -> None:
        """``into ^=`` bytes from ``offset`` of this node's fragment ``index`` (of the stripe a relay names), or
        of its term in ``terms``' reconstruction (computed from a copy of those bytes)."""
        if terms is None:
            self._own_fragment(step, index, chunk_len, offset, into, xor_into)
            return
        local = self._relay_buffers
        if len(getattr(local, "buffer", b"")) < len(into):
            local.buffer = bytearray(len(into))
        own = memoryview(local.buffer)[:len(into)]
        if index < self.layout.k:
            own[:] = bytes(len(own))  # a chunk's bytes past the blob are zeros

        self._own_fragment(step, index, chunk_len, offset, own, _copy)
        self.codec.add_term(terms, index, own, into)

    def _own_fragment(self, step: int, index: int, chunk_len: int, offset: int, into: memoryview,
                      combine: Callable[[memoryview, Buffer], None]) -> None:
        """``combine(part of into, the same bytes of this node's fragment index)`` for bytes from ``offset``: a
        chunk of its blob (parts past it left alone), or a parity fragment, whose pieces are checked first."""
        length = len(into)
        if index < self.layout.k:
            start, at = index * chunk_len + offset, 0
            for file, size, _ in self._image_files(step):
                lo, hi = max(start, at), min(start + length, at + size)
                if lo < hi:
                    combine(into[lo - start:hi - start], memoryview(file.map)[lo - at:hi - at])
                at += size
            return
        file, at = self._parity_range(step, index - self.layout.k, offset, length, checked=True)
        combine(into, file.payload()[at:at + length])

    def _parity_range(self, step: int, t: int, offset: int, length: int, checked: bool) -> tuple[SlotFile, int]:
        """The parity file holding ``step`` and where in its payload bytes ``[offset, offset + length)`` of
        fragment k + t are. ``checked``: the pieces they touch are checked first (:meth:`_check_parity`;
        :class:`~ftrun.snapshot.erasure.CorruptFragment`): a rebuild never receives a corrupt one."""
        file = self.files[self._parity_index(step)]
        assert file is not None
        header = file.header()
        chunk_len = header.data_len // self.place.parity
        if not 0 <= t < self.place.parity or offset < 0 or length < 0 or offset + length > chunk_len:
            raise ValueError("parity range out of bounds")
        if checked:
            self._check_parity(file, header, chunk_len, step, t, offset, length)
        return file, t * chunk_len + offset

    def _check_parity(self, file: SlotFile, header: Header, chunk_len: int, step: int, t: int, offset: int,
                      length: int) -> None:
        """Check every parity piece that bytes ``[offset, offset + length)`` of fragment k + t touch, each whole
        and once per parity file content, against the CRC-32 its metadata records."""
        key = (file.path, header.step, header.checksum)
        checked = self._checked  # one read: the server's threads may replace it meanwhile
        if checked.key != key:
            doc = json.loads(bytes(file.payload()[header.data_len:header.payload_len]))
            layout = StripeLayout(int(doc["group"]), int(doc["parity"]), int(doc["piece"]))
            checked = self._checked = _CheckedParity(key, layout.pieces(chunk_len), doc["piece_crcs"], set())
        stripe = self.layout.parity_stripes(self.place.position)[t]
        for index, (start, n) in enumerate(checked.pieces):
            if start < offset + length and offset < start + n and (t, index) not in checked.good:
                if crc32(file.payload()[t * chunk_len + start:t * chunk_len + start + n]) != \
                        int(checked.crcs[str(stripe)][index]):
                    raise CorruptFragment(f"parity of stripe {stripe} of step {step}, bytes {start}..{start + n}, "
                                          "fails its checksum")
                checked.good.add((t, index))

    # -- parity pushed by the group (module doc) ----------------------------------------------------------------
    def _receive_push(self, request: dict[str, Any], length: int) -> tuple[memoryview, Callable[[bool], None]]:
        """The transport's sink: where a pushed parity piece goes (this encode's parity file), and what checks
        it once it is in; raises if it has no place."""
        if request.get("op") != "parity_put":
            raise ValueError(f"op {request.get('op')!r} takes no payload")
        lower_to_background()  # this connection serves an encoder's pushes (its own thread, lowered for good)
        step, t, offset = int(request["step"]), int(request["t"]), int(request["offset"])
        crc, chunk_len = int(request["crc"]), int(request["chunk_len"])
        deadline = time.monotonic() + PUSH_WAIT
        with self._pushes:
            while True:
                incoming = self._incoming
                if incoming is not None and incoming.step == step and not incoming.closed:
                    if incoming.payload is not None:
                        break
                    self._pushes.wait()  # its parity file is being allocated: the encode fills or closes it
                elif step in self.steps or time.monotonic() >= deadline:
                    raise LookupError(f"node {self.place.node} is not encoding step {step}")
                else:
                    self._pushes.wait(deadline - time.monotonic())
            if t not in incoming.crcs or chunk_len != incoming.chunk_len \
                    or (offset, length) not in incoming.pieces or offset in incoming.crcs[t]:
                raise ValueError(f"no place for parity {t} bytes {offset}..{offset + length} of step {step}")
            incoming.receiving += 1
            base = t * chunk_len + offset
            payload = incoming.payload
            view = payload[base:base + length]

        def done(received: bool) -> None:
            good = received and crc32(payload[base:base + length]) == crc
            with self._pushes:
                incoming.receiving -= 1
                if good and not incoming.closed:
                    incoming.crcs[t][offset] = crc
                incoming.last = time.monotonic()
                self._pushes.notify_all()

        return view, done

    def _pushed(self, op: str, step: int, request: dict[str, Any]) -> Reply:
        """The reply to a pushed piece (whether it was kept) or to a sender's end of a fragment."""
        t = int(request["t"])
        with self._pushes:
            incoming = self._incoming
            if incoming is None or incoming.step != step or incoming.closed or t not in incoming.crcs:
                raise LookupError(f"node {self.place.node} is not encoding step {step}")
            if op == "parity_put_end":
                incoming.ended[t] = request["infos"]
                incoming.last = time.monotonic()
                self._pushes.notify_all()
            elif int(request["offset"]) not in incoming.crcs[t]:
                raise ValueError(f"parity {t} piece at {request['offset']} of step {step} failed its checksum")
        return Reply({})

    def _open_incoming(self, step: int, chunk_len: int, expected: list[int]) -> _Incoming:
        """Take pushed pieces of the parity fragments k + t, t in ``expected``, of ``step``: they wait until
        :meth:`_fill_incoming` names the memory (or the encode ends)."""
        incoming = _Incoming(step, chunk_len, self.layout.pieces(chunk_len), {t: {} for t in expected}, {},
                             last=time.monotonic())
        with self._pushes:
            self._incoming = incoming
            self._pushes.notify_all()
        return incoming

    def _fill_incoming(self, incoming: _Incoming, payload: memoryview) -> None:
        with self._pushes:
            incoming.payload = payload
            incoming.last = time.monotonic()
            self._pushes.notify_all()

    def _await_pushes(self, incoming: _Incoming, infos: Any, generation: int) -> list[int]:
        """Wait until every pushed fragment is complete, no piece came for :data:`PUSH_IDLE` seconds, or the job
        moved to another generation (a node lost: this step's encode is moot); then take no more. Returns the t
        whose fragment is complete (the rest are computed here)."""
        with self._pushes:
            while not all(incoming.complete(t, infos) for t in incoming.crcs):
                idle = time.monotonic() - incoming.last
                if idle >= PUSH_IDLE and not incoming.receiving or self.keeper.generation != generation:
                    break
                self._pushes.wait(min(max(PUSH_IDLE - idle, 0.01), PUSH_POLL))
            return self._close_incoming(incoming, infos)

    def _close_incoming(self, incoming: _Incoming, infos: Any = None) -> list[int]:
        """No more pushes into ``incoming`` (waits for those being received); the complete t (called under
        ``_pushes``)."""
        incoming.closed = True
        self._pushes.notify_all()
        while incoming.receiving:
            self._pushes.wait()
        if self._incoming is incoming:
            self._incoming = None
        incoming.payload = None  # the file's memory is not exported past the encode
        return [t for t in incoming.crcs if incoming.complete(t, infos)]

    def _holder(self, t: int) -> int:
        """The node holding parity fragment k + t of this position's own stripe (it pushes that fragment there)."""
        return self._node(self.layout.parity_position(self.place.position, t))

    def _push(self, step: int, t: int, chunk_len: int, failed: dict[int, Exception]) -> SendPiece:
        """Sends pieces of parity fragment k + t of this position's own stripe to its holder; after the first
        failure, none more of this step (the holder computes the fragment itself)."""
        node = self._holder(t)

        def send(offset: int, piece: memoryview, crc: int) -> None:
            if t in failed:
                return
            try:
                self._request(node, "parity_put", payload=piece, reply_len=0, step=step, t=t, offset=offset,
                              chunk_len=chunk_len, crc=crc)
            except (PeerUnavailable, PeerError) as err:
                failed[t] = err

        return send

    # -- talking to peers -------------------------------------------------------------------------------------
    def _request(self, node: int, op: str, **fields: Any) -> tuple[dict[str, Any], bytes | int]:
        """``op`` to ``node``'s keeper over a pooled connection (:class:`~ftrun.snapshot.transport.PeerPool`):
        the rebuilds' pool for a request marked ``rebuild``, else the encoders'."""
        address = self.peers.get(node)
        if address is None:
            raise PeerUnavailable(f"address of node {node}'s keeper unknown")
        pool = self._rebuild_connections if fields.get("rebuild") else self._connections
        return pool.request(address, op, **fields)

    def _fetch_into(self, node: int, op: str, into: memoryview, **fields: Any) -> None:
        """Receive ``node``'s answer to ``op`` straight into ``into``, which it must fill exactly (else
        :class:`~ftrun.snapshot.transport.PeerWrongLength`, before any byte is received)."""
        self._request(node, op, into=into, reply_len=len(into), **fields)

    def _info(self, node: int, step: int, parity_held: set[int] | None = None) -> tuple[list[int], list[int]]:
        """``node``'s image lengths and checksums of ``step``; adds it to ``parity_held`` if it holds parity of
        ``step`` already."""
        reply, _ = self._request(node, "info", reply_len=0, step=step)
        if parity_held is not None and reply.get("parity") is True:
            parity_held.add(node)
        return [int(n) for n in reply["images"]], [int(c) for c in reply["crcs"]]

    def _node(self, position: int) -> int:
        return self.place.base + position

    # -- encoding ---------------------------------------------------------------------------------------------
    def encode(self, step: int, generation: int, protected: int, fire: Callable[[], None]) -> None:
        """Compute and commit this node's parity of ``step``; raises on a peer failure or changed data."""
        place, layout = self.place, self.layout
        t0 = time.perf_counter()
        self._decoded.expire()  # what a joint rebuild decoded for a replacement that did not ask for it
        done: set[int] = set()  # nodes that hold parity of ``step`` already (and will push none of it)
        infos = {p: (self._local_info(step) if p == place.position else self._info(self._node(p), step, done))
                 for p in range(place.group)}
        chunk_len = layout.chunk_len([sum(images) for images, _ in infos.values()])
        stripes = layout.parity_stripes(place.position)  # stripes[t]: also the position that pushes k + t of it
        expected = [t for t in range(1, place.parity) if self._node(stripes[t]) not in done] if self.pushing else []
        incoming = self._open_incoming(step, chunk_len, expected) if expected else None  # before the allocation
        try:
            with self.keeper.cond:
                index = min(range(PARITY_FILES), key=lambda i: (self.steps[i] == protected and protected > 0,
                                                                -1 if self.steps[i] is None else self.steps[i]))
                self.steps[index] = None
            file = self._ensure(index, place.parity * chunk_len + META_ROOM)
            file.set_state(WRITING)
            t1 = time.perf_counter()
            payload = file.payload()
            if incoming is not None:
                self._fill_incoming(incoming, payload)
            by_t, received, waited = self._code(step, generation, chunk_len, payload, infos, incoming, fire)
        finally:
            if incoming is not None:
                with self._pushes:
                    self._close_incoming(incoming)
        self._check_unchanged(step, infos)
        crcs = {str(stripes[t]): by_t[t] for t in range(place.parity)}
        meta = json.dumps({"step": step, "group": place.group, "parity": place.parity, "backend": place.backend,
                           "position": place.position,
                           "chunk_len": chunk_len, "piece": layout.piece,
                           "images": {str(p): info[0] for p, info in infos.items()},
                           "crcs": {str(p): info[1] for p, info in infos.items()}, "piece_crcs": crcs}).encode()
        data_len = place.parity * chunk_len
        if data_len + len(meta) > file.capacity:
            raise RedundancyError(f"parity metadata of step {step} does not fit ({len(meta)} bytes)")
        payload[data_len:data_len + len(meta)] = meta
        del payload
        header = Header(step=step, generation=generation, digest=self._digest(chunk_len), data_len=data_len,
                        meta_len=len(meta))
        file.commit(header)
        t2 = time.perf_counter()
        file.seal(parity_checksum(file.header(), [c for t in crcs.values() for c in t], meta))
        with self.keeper.cond:  # a new generation's plan may have discarded the slots read since they were checked
            if self._local_images(step) != infos[place.position]:
                file.set_state(EMPTY)
                raise RedundancyError(f"step {step} of node {place.node} was discarded while its parity was computed")
            self.steps[index] = step
            self.keeper.cond.notify_all()
        took = time.perf_counter() - t0
        self.phases = {"prepare": t1 - t0, "code": t2 - t1, "seal": time.perf_counter() - t2, "pushes": waited}
        blob = sum(infos[place.position][0])
        self.keeper.events.emit("parity", f"parity of step {step} for group {place.index} in {took * 1000:.0f} ms "
                                f"({data_len} bytes of parity for blobs of {blob} bytes)", console=False,
                                node=place.node, step=step, seconds=took, parity_bytes=data_len, phases=self.phases,
                                pushed=received)
        self._allocate_other(index, place.parity * chunk_len + META_ROOM)

    def _code(self, step: int, generation: int, chunk_len: int, payload: memoryview,
              infos: dict[int, tuple[list[int], list[int]]], incoming: _Incoming | None,
              fire: Callable[[], None]) -> tuple[dict[int, list[int]], list[int], float]:
        """This node's m parity fragments of ``step`` into ``payload``: fragment k of its own stripe computed
        (with m >= 2 the stripe's other fragments pushed to their holders), the others taken as pushed into
        ``incoming`` by their stripes' positions or else computed here. Returns the CRC-32 of each piece by t, the
        t received by push, and the seconds spent waiting for pushes."""
        place = self.place
        by_t: dict[int, list[int]] = {}  # the CRC-32 of each piece of parity fragment k + t
        received: list[int] = []  # the t pushed by their stripes' own positions
        waited = 0.0  # seconds waiting for pushes after this keeper's own stripe was done
        read = _infos_doc(infos)
        failed: dict[int, Exception] = {}
        also = {u: self._push(step, u, chunk_len, failed) for u in range(1, place.parity)} if self.pushing else {}
        by_t[0] = self._encode_stripe(step, 0, chunk_len, payload, also)
        fire()
        if also:
            self._check_unchanged(step, infos)
            for u in also:
                if u not in failed:
                    self._tell_end(step, u, read)
        if incoming is not None:
            waited = time.perf_counter()
            for t in self._await_pushes(incoming, read, generation):
                by_t[t] = [incoming.crcs[t][o] for o, _ in incoming.pieces]
                received.append(t)
            waited = time.perf_counter() - waited
        for t in range(1, place.parity):
            if t not in by_t:
                by_t[t] = self._encode_stripe(step, t, chunk_len, payload)
                fire()
        return by_t, received, waited

    def _encode_stripe(self, step: int, t: int, chunk_len: int, payload: memoryview,
                       also: Mapping[int, SendPiece] | None = None) -> list[int]:
        """Parity fragment k + t of this position's stripe t into the parity file, from data fetched from the
        group; ``also``: other fragments of the same stripe handed on (:meth:`_push`). Returns its piece CRCs."""
        layout = self.layout
        stripe = layout.parity_stripes(self.place.position)[t]

        def fetch_into(i: int, offset: int, length: int, into: memoryview) -> None:
            self._fetch_into(self._node(layout.data_position(stripe, i)), "chunk", into, step=step, chunk=i,
                             offset=offset, length=length, chunk_len=chunk_len)

        return encode_parity(self.codec, layout, stripe, t, chunk_len, fetch_into,
                             payload[t * chunk_len:(t + 1) * chunk_len], self._encode_pool, self._encode_scratch,
                             also)

    def _check_unchanged(self, step: int, infos: dict[int, tuple[list[int], list[int]]]) -> None:
        """Raises unless every position still holds the images of ``step`` it held when the encode began."""
        for position, info in infos.items():
            now = self._local_info(step) if position == self.place.position else self._info(self._node(position),
                                                                                            step)
            if now != info:
                raise RedundancyError(f"step {step} of node {self._node(position)} changed while encoding")

    def _tell_end(self, step: int, t: int, read: Any) -> None:
        """Tells the holder of parity k + t of this position's stripe that every piece was sent, from the data
        ``read`` (unchanged since): it may use them. A holder gone or not listening computes its own."""
        try:
            self._request(self._holder(t), "parity_put_end", reply_len=0, step=step, t=t, infos=read)
        except (PeerUnavailable, PeerError):
            pass

    def _local_images(self, step: int) -> tuple[list[int], list[int]] | None:
        """:meth:`_local_info`, or None when this node no longer holds ``step`` sealed."""
        try:
            return self._local_info(step)
        except LookupError:
            return None

    def _local_info(self, step: int) -> tuple[list[int], list[int]]:
        images = self._images(step)
        return [n for _, n, _ in images], [c for _, _, c in images]

    def _digest(self, chunk_len: int) -> int:
        shape = f"{self.place.group}/{self.place.parity}/{self.place.backend}/{chunk_len}/{self.layout.piece}"
        return int.from_bytes(hashlib.sha256(shape.encode()).digest()[:8], "little")

    def _ensure(self, index: int, payload: int) -> SlotFile:
        """Parity file ``index`` with room for ``payload``; OSError (ENOSPC: the shm dir is full) leaves it None
        and :attr:`wanted` its size."""
        file = self.files[index]
        if file is not None and file.capacity >= payload:
            return file
        if file is not None:
            file.close()
            self.files[index] = None
        self.wanted = HEADER_SIZE + payload
        file = self.files[index] = SlotFile(self.path(index), self.wanted, populate=True)
        return file

    def _allocate_other(self, index: int, payload: int) -> None:
        """The other parity file sized like this one and allocated, unless it holds parity: the encoder does it
        while it waits for the next step, so only the first encode waits for parity pages. A full /dev/shm is
        left to the next encode to report."""
        other = 1 - index
        with self.keeper.cond:
            if self.steps[other] is not None:
                return
        try:
            self._ensure(other, payload)
        except OSError:
            pass

    # -- rebuilding -------------------------------------------------------------------------------------------
    def prepare(self, step: int, holder: int) -> int:
        """Start allocating this node's slots for a rebuild of ``step`` before it is asked for, sized by the
        parity metadata of ``holder`` (a node of the group holding parity of ``step``): a replacement node's
        memory is then allocated while the job still agrees its plan. :meth:`rebuild` takes these slots when its
        sizes agree; :meth:`drop_prepared` gives them up. Returns the bytes being allocated."""
        images = self._my_images(self._parity_meta(holder, step))
        self.drop_prepared()
        writer = _BlobWriter(self.keeper, step, images)
        with self._prepared_lock:
            self._prepared = writer
        return writer.memory.total

    def drop_prepared(self) -> None:
        """Give up the slots :meth:`prepare` claimed (emptied; what is allocated of them stays, as any slot's)."""
        with self._prepared_lock:
            writer, self._prepared = self._prepared, None
        if writer is not None:
            writer.abandon()

    def _take_prepared(self, step: int, images: list[int]) -> _BlobWriter | None:
        """The prepared writer if it is for these image lengths (then for ``step``); else None, dropped."""
        with self._prepared_lock:
            writer, self._prepared = self._prepared, None
        if writer is not None and writer.images != images:
            writer.abandon()
            return None
        if writer is not None:
            writer.step = step
        return writer

    def _parity_meta(self, node: int, step: int) -> dict[str, Any]:
        _, raw = self._request(node, "parity_meta", step=step)
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise RedundancyError(f"node {node} sent parity metadata that is not a JSON object")
        return meta

    def _my_images(self, meta: dict[str, Any]) -> list[int]:
        """This node's image lengths, one per local rank, as a group's parity metadata records them."""
        place = self.place
        if (meta["group"], meta["parity"], meta["backend"]) != (place.group, place.parity, place.backend):
            raise RedundancyError("parity was computed for another group shape")
        images = [int(n) for n in meta["images"][str(place.position)]]
        if len(images) != len(self.keeper.ranks) or any(n < HEADER_SIZE for n in images):
            raise RedundancyError(f"parity records images {images} for node {place.node}, which has "
                                  f"{len(self.keeper.ranks)} local ranks")
        return images

    def rebuild(self, step: int, complete: list[int]) -> tuple[int, float]:
        """Rebuild every local rank's slot of ``step`` from the nodes in ``complete`` (they hold the step and its
        parity); the slots are verified and held afterwards. Returns (bytes rebuilt, seconds)."""
        place, layout = self.place, self.layout
        t0 = time.perf_counter()
        metas: dict[int, dict[str, Any]] = {}

        def meta_of(position: int) -> dict[str, Any]:
            if position not in metas:
                metas[position] = self._parity_meta(self._node(position), step)
            return metas[position]

        stripes = [layout.chunk_stripe(place.position, c) for c in range(layout.k)]
        holders = {}
        for stripe in stripes:
            holder = next((layout.parity_position(stripe, t) for t in range(place.parity)
                           if self._node(layout.parity_position(stripe, t)) in complete), None)
            if holder is None:
                raise RedundancyError(f"no surviving holder of parity of stripe {stripe} of step {step}")
            holders[stripe] = holder
        first = meta_of(holders[stripes[0]])
        images = self._my_images(first)
        chunk_len = int(first["chunk_len"])
        piece_layout = StripeLayout(place.group, place.parity, int(first["piece"]))
        blob = sum(images)
        t1 = time.perf_counter()
        writer = self._take_prepared(step, images) or _BlobWriter(self.keeper, step, images)
        self.allocated_ahead = writer.memory.allocated
        t2 = time.perf_counter()
        chains = None if self._on_this_host(complete) else self._chains(stripes, complete, piece_layout)
        self.relayed = chains is not None
        self.decoded = chains is not None and any(others for _, _, others in chains)
        try:
            if chains is not None:
                try:
                    xor = all(terms is None for _, terms, _ in chains)
                    part = RELAY_PART_NIC if xor else RELAY_PART
                    self._rebuild_relayed(step, stripes, chains, chunk_len, writer, blob, part)
                    t3 = time.perf_counter()
                    writer.finish()
                except (PeerError, RedundancyError) as err:  # a survivor's content: the direct rebuild checks it
                    self.keeper.events.emit("rebuild_relay_failed", f"relayed rebuild of step {step} failed ({err}); "
                                            "rebuilding from each survivor directly", node=place.node, step=step)
                    self.relayed = self.decoded = False
            if not self.relayed:
                self._rebuild_direct(step, complete, stripes, holders, chunk_len, piece_layout, writer, blob, meta_of)
                t3 = time.perf_counter()
                writer.finish()
        except BaseException:
            writer.abandon()
            raise
        t4 = time.perf_counter()
        self.phases = {"meta": t1 - t0, "claim": t2 - t1, "transfer": t3 - t2, "verify": t4 - t3,
                       "waited_for_memory": writer.memory.waited}
        return blob, t4 - t0

    def _chains(self, stripes: list[int], complete: list[int], layout: StripeLayout
                ) -> list[tuple[list[int], Terms | None, tuple[int, ...]]] | None:
        """For each chunk of this node (of ``stripes``), the fragments whose holders sum it along a chain, in
        chain order, and how: XOR (None: parity k and the other data fragments survive) or the terms of k
        surviving fragments (:class:`~ftrun.snapshot.erasure.Terms`); and the other data fragments of the stripe
        that are lost too (then the chunk is decoded by its sources in turn, not summed along a chain: module
        doc). None when no chunk is to be relayed (k = 1: a copy) or one cannot be (fewer than k survive). Chunk
        c's chain starts at the position c + 1 after this one, so the survivors send alike."""
        if layout.k < 2:
            return None
        chains: list[tuple[list[int], Terms | None, tuple[int, ...]]] = []
        for chunk, stripe in enumerate(stripes):
            alive = [i for i in range(layout.group)
                     if i != chunk and self._node(layout.position(stripe, i)) in complete]
            terms, others = None, ()
            fragments = xor_fragments(layout.k, chunk)
            if not (self.codec.xor_first and set(fragments) <= set(alive)):
                if len(alive) < layout.k:
                    return None
                terms = Terms(chunk, tuple(alive[:layout.k]))  # data fragments first: no parity to check
                fragments = list(terms.sources)
                others = tuple(i for i in range(layout.k) if i != chunk and i not in alive)
            chains.append((sorted(fragments, key=lambda i, s=stripe, c=chunk: (
                layout.position(s, i) - self.place.position - 1 - c) % layout.group), terms, others))
        return chains

    def _on_this_host(self, nodes: list[int]) -> bool:
        """Whether every node of ``nodes`` serves its peers from this node's host (no NIC between them): then the
        rebuild is direct, not relayed (module doc). benchmarks/erasure.py, all nodes on one host, in the job: k=2
        m=1 on 16 cores relayed 0.16-0.28 s, direct 0.15-0.20 s (9 and 6 jobs, 4 and 2 with a hot spare); on 2
        cores relayed 0.42-0.53 s, direct 0.36-0.45 s (6 and 3 jobs); k=4 m=2, two lost, on 2 cores, terms relayed
        2.2-2.3 s, direct 0.86-0.94 s."""
        host = self.peers.get(self.place.node, "").rpartition(":")[0]
        return bool(host) and all(self.peers.get(node, "").rpartition(":")[0] == host for node in nodes)

    def _rebuild_relayed(self, step: int, stripes: list[int],
                         chains: list[tuple[list[int], Terms | None, tuple[int, ...]]],
                         chunk_len: int, writer: _BlobWriter, blob: int, part: int) -> None:
        """Every chunk summed along its chain, or decoded by its sources with the other lost chunks of its
        stripe (:meth:`_chains`; module doc), in requests of ``part`` bytes at most: this node receives each byte
        once. As many requests are in flight as the pool has threads."""
        requests = []
        for chunk, (stripe, (parts, terms, others)) in enumerate(zip(stripes, chains)):
            for segment in writer.segments(chunk * chunk_len, chunk_len, part):
                if segment.into is not None:
                    requests.append((chunk * chunk_len, stripe, parts, terms, others, segment))

        failed = threading.Event()  # after a failure no request starts (a silent peer costs one timeout)

        def fetch(base: int, stripe: int, parts: list[int], terms: Terms | None, others: tuple[int, ...],
                  segment: Segment) -> None:
            assert segment.into is not None
            if failed.is_set():
                return
            try:
                writer.ready(min(base + segment.offset + segment.length, blob))  # ``into`` is the slots' memory
                if terms is not None and others:
                    self._fetch_decoded(step, stripe, terms, others, chunk_len, segment.offset, segment.into)
                else:
                    self._fetch_fragments(step, stripe, parts, chunk_len, segment.offset, segment.into, terms)
            except BaseException:
                failed.set()
                raise

        futures = [self._pool.submit(fetch, *request) for request in requests]
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()
            futures_wait(futures)  # none writes into the slots after this returns

    def _rebuild_direct(self, step: int, complete: list[int], stripes: list[int], holders: dict[int, int],
                        chunk_len: int, layout: StripeLayout, writer: _BlobWriter, blob: int,
                        meta_of: Callable[[int], dict[str, Any]]) -> None:
        """Every chunk from k fragments of its stripe, each fetched from its holder here
        (:func:`~ftrun.snapshot.erasure.rebuild_chunk`; parity pieces checked against their CRC-32)."""
        place = self.place
        for chunk, stripe in enumerate(stripes):
            def fetch_into(index: int, offset: int, length: int, into: memoryview, stripe: int = stripe,
                           base: int = chunk * chunk_len) -> None:
                writer.ready(min(base + offset + length, blob))  # ``into`` may be the slots' memory
                self._fetch_fragments(step, stripe, [index], chunk_len, offset, into)

            sources = [i for i in range(place.group) if self._node(layout.position(stripe, i)) in complete]
            held = meta_of(holders[stripe])
            t = layout.parity_stripes(holders[stripe]).index(stripe)
            rebuild_chunk(self.codec, layout, chunk, chunk_len, sources, fetch_into,
                          writer.segments(chunk * chunk_len, chunk_len, layout.piece_len),
                          lambda offset, data, base=chunk * chunk_len: writer.write(base + offset, data),
                          self._pool, self._scratch, {layout.k + t: held["piece_crcs"][str(stripe)]})


def _copy(target: memoryview, source: Buffer) -> None:
    target[:] = source


def _infos_doc(infos: dict[int, tuple[list[int], list[int]]]) -> dict[str, list[list[int]]]:
    """The images of every position that an encode read, as JSON keeps them (pushes compare them)."""
    return {str(p): [list(images), list(crcs)] for p, (images, crcs) in sorted(infos.items())}


def parity_checksum(header: Header, piece_crcs: list[int], meta: bytes) -> int:
    """The seal of a parity file: the CRC-32 of every parity piece (in order), folded with the header's identity
    and the metadata, which records them: each piece can be checked alone (a rebuild checks what it fetches)."""
    identity = struct.pack("<qqQQQ", header.step, header.generation, header.digest, header.data_len, header.meta_len)
    return crc32(struct.pack(f"<{len(piece_crcs)}I", *piece_crcs), crc32(meta, crc32(identity)))


def parity_problem(file: SlotFile) -> str | None:
    """Why a committed parity file is not valid (its pieces against its metadata, then its seal), or None."""
    header = file.header()
    try:
        meta = bytes(file.payload()[header.data_len:header.payload_len])
        doc = json.loads(meta)
        layout = StripeLayout(int(doc["group"]), int(doc["parity"]), int(doc["piece"]))
        chunk_len = int(doc["chunk_len"])
        stripes = layout.parity_stripes(int(doc["position"]))
        recorded = [[int(c) for c in doc["piece_crcs"][str(s)]] for s in stripes]
    except (ValueError, KeyError, TypeError) as err:
        return f"unreadable parity metadata ({err})"
    if header.data_len != layout.parity * chunk_len:
        return f"{header.data_len} bytes of parity for chunks of {chunk_len}"
    payload = file.payload()
    for t, crcs in enumerate(recorded):
        found = [crc32(payload[t * chunk_len + o:t * chunk_len + o + n]) for o, n in layout.pieces(chunk_len)]
        if found != crcs:
            return f"parity of stripe {stripes[t]} fails its checksum"
    if not header.sealed or parity_checksum(header, [c for t in recorded for c in t], meta) != header.checksum:
        return "seal mismatch"
    return None


class _BlobWriter:
    """Writes a rebuilt blob into one slot per local rank (the one not holding the newest step), then verifies.

    The slots' memory is allocated in blob order ahead of the transfer (:class:`AheadAllocator`): :meth:`ready`
    waits until the bytes up to a blob offset may be written; a full /dev/shm fails the rebuild there."""

    def __init__(self, keeper: SlotHolder, step: int, images: list[int]) -> None:
        self.keeper = keeper
        self.step = step
        self.images = images
        self.targets: list[tuple[int, int, SlotFile, int, int]] = []  # (local, index, file, blob start, length)
        start = 0
        for local, length in enumerate(images):
            index, file = keeper.claim_vacant(local, length, allocate=False)
            self.targets.append((local, index, file, start, length))
            start += length
        self.memory = AheadAllocator([(file, length) for _, _, file, _, length in self.targets])

    def ready(self, end: int) -> None:
        """Wait until blob bytes ``[0, end)`` may be written; raises if their memory could not be allocated."""
        try:
            self.memory.ready(end)
        except OSError as err:
            raise RedundancyError(f"no room for the rebuilt slots in {self.keeper.dir}: {err}") from err

    def segments(self, start: int, length: int, piece: int) -> list[Segment]:
        """Bytes ``[start, start + length)`` of the blob as segments, each within one coding piece (``piece``
        bytes from ``start`` on) and one slot file (``into``: that file's memory), or past the last image
        (``into`` None); offsets from ``start``."""
        found = []
        end = start + length
        covered = start
        for _, _, file, begin, size in self.targets:
            lo, hi = max(start, begin), min(end, begin + size)
            at = lo
            while at < hi:
                n = min(hi, start + ((at - start) // piece + 1) * piece) - at  # to the next piece's start
                found.append(Segment(at - start, n, memoryview(file.map)[at - begin:at - begin + n]))
                at += n
            covered = max(covered, hi)
        if covered < end:
            found.append(Segment(covered - start, end - covered, None))
        return found

    def write(self, offset: int, data: Buffer) -> None:
        view = memoryview(data)
        end = offset + len(view)
        for _, _, file, begin, length in self.targets:
            lo, hi = max(offset, begin), min(end, begin + length)
            if lo < hi:
                self.ready(hi)
                file.map[lo - begin:hi - begin] = view[lo - offset:hi - offset]

    def finish(self) -> None:
        self.ready(self.memory.total)  # and the trainers' headroom, allocated last
        for local, index, file, _, _ in self.targets:
            problem = file.verify()
            if problem is None and file.header().step != self.step:
                problem = f"holds step {file.header().step}"
            if problem is not None:
                raise RedundancyError(f"rebuilt slot of local rank {local} is not valid: {problem}")
        for local, index, _, _, _ in self.targets:
            self.keeper.hold_restored(local, index, self.step)

    def abandon(self) -> None:
        self.memory.stop()
        for _, _, file, _, _ in self.targets:
            file.set_state(EMPTY)
