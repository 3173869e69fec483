"""The stripe layout and codec of ftrun.snapshot.erasure, property-based: any m lost nodes of a group are rebuilt
byte for byte from the survivors, whatever the group shape and blob sizes."""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyeclib.ec_iface import ECDriver
from isal.isal_zlib import crc32

from ftrun.snapshot import gf_kernels
from ftrun.snapshot.gf_kernels import ENV_ISAL_LIBRARY, PROBE, Combination, load_isal
from ftrun.snapshot.ec_groups import BACKENDS, DEFAULT_BACKEND, default_group, group_problem
from ftrun.snapshot.erasure import (ALIGN, CODE_PART, PIECE, Codec, CorruptFragment, Segment, StripeLayout, Terms,
                                    encode_parity, rebuild_chunk)
from ftrun.snapshot.link import (Holdings, RestorePlan, losses_covered, plan_restore, rebuild_candidate,
                                 start_over_reason)
from ftrun.snapshot.redundancy import _BlobWriter


@st.composite
def groups(draw):
    group = draw(st.integers(2, 6))
    parity = draw(st.integers(1, group - 1))
    blobs = [draw(st.binary(min_size=0, max_size=3 * ALIGN + 17)) for _ in range(group)]
    if not any(blobs):
        blobs[0] = b"x"
    lost = draw(st.lists(st.integers(0, group - 1), min_size=parity, max_size=parity, unique=True))
    piece = draw(st.sampled_from([ALIGN, 2 * ALIGN]))
    backend = draw(st.sampled_from(BACKENDS))
    split = draw(st.integers(1, 3 * ALIGN))  # where the rebuilt blob's memory is cut in two (two slot files)
    return group, parity, blobs, sorted(lost), piece, backend, split


def encode_group(layout: StripeLayout, codec: Codec, blobs: list[bytes]):
    """Every position's parity payloads, as the keepers compute them."""
    chunk_len = layout.chunk_len([len(b) for b in blobs])
    padded = [b.ljust(layout.k * chunk_len, b"\0") for b in blobs]
    parity: dict[tuple[int, int], bytearray] = {}
    with ThreadPoolExecutor(4) as pool:
        for position in range(layout.group):
            for t, stripe in enumerate(layout.parity_stripes(position)):
                def fetch_into(i: int, offset: int, length: int, into: memoryview, stripe: int = stripe) -> None:
                    start = i * chunk_len + offset
                    into[:] = padded[layout.data_position(stripe, i)][start:start + length]

                parity[position, t] = bytearray(chunk_len)
                encode_parity(codec, layout, stripe, t, chunk_len, fetch_into, memoryview(parity[position, t]), pool)
    return chunk_len, padded, parity


@settings(max_examples=80, deadline=None)
@given(groups())
def test_any_m_lost_positions_are_rebuilt_byte_for_byte(case):
    group, parity_count, blobs, lost, piece, backend, split = case
    layout = StripeLayout(group, parity_count, piece)
    codec = Codec(layout.k, parity_count, backend)
    chunk_len, padded, parity = encode_group(layout, codec, blobs)
    assert chunk_len % ALIGN == 0 and chunk_len * layout.k >= max(len(b) for b in blobs)
    for position in lost:
        size = len(blobs[position])
        memory = [bytearray(min(split, size)), bytearray(max(0, size - split))]  # the blob over two "files"
        views = [memoryview(memory[0]), memoryview(memory[1])]

        def where(at: int, n: int) -> memoryview:
            return views[0][at:at + n] if at < len(memory[0]) else views[1][at - len(memory[0]):at - len(memory[0]) + n]

        for chunk in range(layout.k):
            stripe = layout.chunk_stripe(position, chunk)
            base = chunk * chunk_len

            def fetch_into(index: int, offset: int, length: int, into: memoryview, stripe: int = stripe) -> None:
                holder = layout.position(stripe, index)
                assert holder not in lost
                if index < layout.k:
                    start = index * chunk_len + offset
                    into[:] = padded[holder][start:start + length]
                else:
                    into[:] = parity[holder, index - layout.k][offset:offset + length]

            # segments as a keeper cuts them: at every coding piece, at the end of the first "file" and of the blob
            cuts = {*range(base, base + chunk_len, piece), base + chunk_len,
                    *(c for c in (len(memory[0]), size) if base < c < base + chunk_len)}
            bounds = sorted(cuts)
            segments = [Segment(a - base, b - a, where(a, b - a) if a < size else None)
                        for a, b in zip(bounds, bounds[1:])]

            def write(offset: int, data, base: int = base) -> None:
                for o in range(len(data)):
                    if base + offset + o < size:
                        where(base + offset + o, 1)[0] = data[o]

            sources = [i for i in range(group) if layout.position(stripe, i) not in lost]
            with ThreadPoolExecutor(4) as pool:
                rebuild_chunk(codec, layout, chunk, chunk_len, sources, fetch_into, segments, write, pool)
        assert bytes(memory[0] + memory[1]) == blobs[position]


@pytest.fixture(params=["isa-l", "pyeclib"])
def kernels(request, monkeypatch):
    """Both engines of the codec's Reed-Solomon arithmetic: ISA-L's kernels with coefficients learned from
    pyeclib (the default where ISA-L's field is the code's), and pyeclib alone (no ISA-L library found)."""
    if request.param == "pyeclib":
        monkeypatch.setenv(ENV_ISAL_LIBRARY, "")
    load_isal.cache_clear()
    yield request.param
    load_isal.cache_clear()


def uses_isal(codec: Codec, kernels: str) -> bool:
    """Whether ``codec`` computed its combinations with ISA-L, as expected with ``kernels``: ISA-L's backends,
    not liberasurecode's own field."""
    used = {combination is not None for combination in codec._combinations.values()}
    expected = kernels == "isa-l" and codec.backend.startswith("isa_l")
    assert used <= {expected}, (codec.backend, kernels)
    return expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,m", [(1, 1), (2, 1), (3, 1), (4, 2), (2, 3)])
def test_parity_is_pyeclibs_own_bytes(backend, k, m, kernels):
    """The XOR fast path and parity by reconstruction give exactly the parity payloads of pyeclib's encode, alone
    and with the stripe's other parity fragments computed from the same data pieces and handed on (``also``,
    as a keeper pushes them to their holders), each with its CRC-32."""
    layout = StripeLayout(k + m, m, 2 * ALIGN)
    codec = Codec(k, m, backend)
    chunk_len = 5 * ALIGN  # three pieces, the last shorter
    data = os.urandom(k * chunk_len)

    def fetch(i: int, offset: int, length: int, into: memoryview) -> None:
        into[:] = data[i * chunk_len + offset:i * chunk_len + offset + length]

    def expected(t: int, offset: int, length: int) -> bytes:
        piece = b"".join(data[i * chunk_len + offset:i * chunk_len + offset + length] for i in range(k))
        return piece[:length] if k == 1 else ECDriver(k=k, m=m, ec_type=backend).encode(piece)[k + t][80:]

    for t in range(m):
        out = bytearray(chunk_len)
        crcs = encode_parity(codec, layout, 0, t, chunk_len, fetch, memoryview(out))
        for offset, length in layout.pieces(chunk_len):
            assert bytes(out[offset:offset + length]) == expected(t, offset, length), (t, offset)
        assert crcs == [crc32(out[o:o + n]) for o, n in layout.pieces(chunk_len)]
    handed: dict[tuple[int, int], tuple[bytes, int]] = {}
    out = bytearray(chunk_len)
    also = {u: lambda offset, piece, crc, u=u: handed.__setitem__((u, offset), (bytes(piece), crc))
            for u in range(1, m)}
    encode_parity(codec, layout, 0, 0, chunk_len, fetch, memoryview(out), also=also)
    for offset, length in layout.pieces(chunk_len):
        assert bytes(out[offset:offset + length]) == expected(0, offset, length), offset
        for u in range(1, m):
            assert handed[u, offset] == (expected(u, offset, length), crc32(expected(u, offset, length))), (u, offset)
    assert len(handed) == (m - 1) * len(layout.pieces(chunk_len))
    assert codec.xor_first == (k == 1 or backend != "isa_l_rs_cauchy")
    uses_isal(codec, kernels)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,m", [(2, 2), (4, 2), (3, 3)])
def test_the_xor_of_the_sources_terms_is_pyeclibs_reconstruction(backend, k, m, kernels):
    """Each lost data fragment is the XOR of the terms of k survivors (what a relayed rebuild sums along their
    holders), over any range that starts aligned, a short last one included; bad terms never reach pyeclib."""
    driver = ECDriver(k=k, m=m, ec_type=backend)
    length = 3 * CODE_PART + 5 * ALIGN
    fragments = [bytes(f[80:]) for f in driver.encode(os.urandom(k * length))]
    codec = Codec(k, m, backend)
    lost = (0, k - 1)
    sources = [i for i in range(k + m) if i not in lost][:k]
    for want in lost:
        for start, end in ((0, length), (2 * ALIGN, 2 * ALIGN + 1000)):
            out = bytearray(end - start)
            for i in sources:
                codec.add_term(Terms(want, tuple(sources)), i, fragments[i][start:end], memoryview(out))
            assert bytes(out) == fragments[want][start:end], (want, start)
    assert codec._combinations
    uses_isal(codec, kernels)
    for bad_sources, index, want in ((sources[:-1], sources[0], 0), (sources, lost[0], 0),
                                     ([lost[0], *sources[1:]], lost[0], lost[0]), (sources, sources[0], k + m)):
        with pytest.raises(ValueError, match="term of fragment"):
            codec.add_term(Terms(want, tuple(bad_sources)), index, fragments[0][:ALIGN], memoryview(bytearray(ALIGN)))


def test_malformed_pieces_never_reach_pyeclib():
    codec = Codec(2, 1, "isa_l_rs_cauchy")  # no XOR path: pyeclib computes

    def pieces(*lengths: int) -> list[memoryview]:
        return [memoryview(bytearray(n)) for n in lengths]

    for data, length in ((pieces(ALIGN), ALIGN), (pieces(ALIGN, 100), ALIGN), (pieces(10, 10), 10)):
        with pytest.raises(ValueError, match="need 2 pieces"):
            codec.parity(data, 0, memoryview(bytearray(length)))
    with pytest.raises(ValueError, match="need 2 pieces"):
        codec.reconstruct(dict(zip((0, 2), pieces(ALIGN, ALIGN - 1))), 1, memoryview(bytearray(ALIGN)))


@pytest.mark.parametrize("length", [ALIGN, CODE_PART, 3 * CODE_PART + 5 * ALIGN])
def test_a_piece_coded_in_parts_is_pyeclibs_own_bytes(length, kernels):
    """Parity and a rebuilt fragment of a piece coded part by part (the last part shorter) are exactly what
    pyeclib gives for the whole piece at once."""
    k, m = 4, 2
    codec, driver = Codec(k, m), ECDriver(k=k, m=m, ec_type=DEFAULT_BACKEND)
    data = os.urandom(k * length)
    whole = [bytes(f[80:]) for f in driver.encode(data)]
    for t in range(m):
        out = bytearray(length)
        codec.parity([whole[i] for i in range(k)], t, memoryview(out))
        assert bytes(out) == whole[k + t]
    out = bytearray(length)
    codec.reconstruct({i: whole[i] for i in (2, 3, 4, 5)}, 0, memoryview(out))  # two lost: 0 and 1
    assert bytes(out) == whole[0]
    assert uses_isal(codec, kernels) == (kernels == "isa-l")


def test_isa_l_kernels_take_their_coefficients_from_pyeclib_and_refuse_another_field(monkeypatch):
    """A combination learned from pyeclib's terms gives pyeclib's bytes for any input, in several calls where it
    is longer than one call takes; a code over another representation of GF(2^8) (liberasurecode's own
    Vandermonde code) fails the check and stays with pyeclib."""
    monkeypatch.setattr(gf_kernels, "CALL_BYTES", 5000)
    lib = load_isal()
    assert lib is not None  # pyeclib's wheel ships ISA-L
    k, m, sources, want = 4, 2, (1, 2, 4, 5), 0
    for backend, field in (("isa_l_rs_vand", True), ("isa_l_rs_cauchy", True), ("liberasurecode_rs_vand", False)):
        driver = ECDriver(k=k, m=m, ec_type=backend)

        def term(n: int, data: bytes) -> bytes:
            fragments = driver.encode(bytes(k * len(data)))
            pieces = [f[:80] + (data if i == sources[n] else bytes(len(data))) for i, f in enumerate(fragments)]
            return bytes(driver.reconstruct([pieces[i] for i in sources], [want])[0][80:])

        combination = Combination.learned(lib, term, k)
        assert (combination is not None) == field, backend
        if combination is None:
            continue
        fragments = [bytes(f[80:]) for f in driver.encode(os.urandom(k * 3 * ALIGN))]
        out = bytearray(3 * ALIGN - 7)  # any length
        combination([fragments[i][:len(out)] for i in sources], memoryview(out))
        assert bytes(out) == fragments[want][:len(out)], backend
        combination.add(2, fragments[4][:len(out)], memoryview(out))  # fragment 4's term taken out again
        without = bytearray(len(out))
        combination([fragments[i][:len(out)] if i != 4 else bytes(len(out)) for i in sources], memoryview(without))
        assert out == without
    with pytest.raises(ValueError):
        Combination(lib, [1, 256])
    with pytest.raises(ValueError, match="need 2 sources"):
        Combination(lib, [1, 2])([PROBE], memoryview(bytearray(len(PROBE))))


@pytest.mark.parametrize("group,parity", [(2, 1), (3, 1), (4, 2), (5, 3), (6, 1)])
def test_every_position_holds_m_parity_fragments_and_is_data_in_k_stripes(group, parity):
    layout = StripeLayout(group, parity)
    for position in range(group):
        data_stripes = {layout.chunk_stripe(position, c) for c in range(layout.k)}
        parity_stripes = set(layout.parity_stripes(position))
        assert len(data_stripes) == layout.k and len(parity_stripes) == parity
        assert data_stripes | parity_stripes == set(range(group)) and not data_stripes & parity_stripes
    for stripe in range(group):  # every stripe has one fragment on every position
        assert sorted(layout.position(stripe, i) for i in range(group)) == list(range(group))
    for position, chunk in itertools.product(range(group), range(layout.k)):
        assert layout.data_position(layout.chunk_stripe(position, chunk), chunk) == position


def test_default_groups_and_invalid_combinations():
    assert default_group(1) == (1, 0)
    assert [default_group(n) for n in (2, 3, 4, 6, 8, 9, 5)] == [(2, 1), (3, 1), (4, 1), (3, 1), (4, 1), (3, 1),
                                                                  (5, 1)]
    assert group_problem(4, 2, 1, "isa_l_rs_vand") is None and group_problem(1, 1, 0, "isa_l_rs_vand") is None
    assert "smaller than --ec-group" in group_problem(4, 2, 2, "isa_l_rs_vand")
    assert "larger than --nnodes" in group_problem(2, 4, 1, "isa_l_rs_vand")
    assert "cannot be divided" in group_problem(6, 4, 1, "isa_l_rs_vand")
    assert "not available" in group_problem(4, 2, 1, "jerasure_rs_vand")


def test_pieces_are_bounded_and_cover_the_fragment():
    layout = StripeLayout(4, 1)
    chunk_len = 300 << 20
    pieces = layout.pieces(chunk_len)
    assert pieces[0] == (0, 8 << 20) and sum(n for _, n in pieces) == chunk_len
    assert all(o % ALIGN == 0 for o, _ in pieces)


def holdings(ranks: dict[int, list[int]], parity: list[int]) -> Holdings:
    return Holdings({r: set(s) for r, s in ranks.items()}, set(parity))


def test_a_restart_before_every_rank_committed_a_snapshot_says_so_not_that_snapshots_were_lost():
    """A crash at step 1 (4 nodes, EC k=2 m=1), rank 2 alone had committed step 1: the restart from step 0 was
    reported as "ranks [0, 1, 3] lost their snapshots ... more nodes of a group lost than its 1 parity cover". Ranks
    lose a snapshot only once every rank had committed one (``secured``)."""
    every = {0: set(), 1: set(), 2: {1}, 3: set()}
    assert start_over_reason(every, 1, 0, 0) == ("no snapshot step was committed by every rank yet (ranks [0-1, 3] "
                                                 "hold none)")
    assert "by every rank since generation 2 started from step 0" in start_over_reason(every, 1, 0, 2)
    lost = start_over_reason(every, 1, 1, 0)
    assert lost.startswith("ranks [0-1, 3] lost their snapshots; step 1, held by every other rank") and \
        "more nodes of a group lost than its 1 parity cover" in lost
    # a node lost while the step's parity was computed: one lost node, which m = 1 covers (node 0 cut off the
    # network during a parity push was said to be "more nodes of a group lost than its 1 parity cover")
    assert "its parity is not complete on enough other nodes of the group" in start_over_reason(every, 1, 1, 0,
                                                                                                 covered=True)
    one_lost = {0: holdings({0: []}, []), 1: holdings({1: [10]}, []), 2: holdings({2: [10]}, [10])}
    assert losses_covered(one_lost, 3, 1) and not losses_covered({**one_lost, 1: holdings({1: []}, [])}, 3, 1)
    assert losses_covered({**one_lost, 4: holdings({4: []}, [])}, 3, 1)  # one lost node in each of two groups
    assert start_over_reason({0: set(), 1: {5}}, 0, 5, 0).endswith("(erasure coding is off)")
    many = start_over_reason({**{r: set() for r in range(0, 20000, 2)}, 1: {5}}, 1, 5, 0)
    assert many.startswith("ranks [0, 2, 4, 6, 8, 10, 12, 14, ... (10000 in all)] lost their snapshots"), many
    assert start_over_reason({0: {2}, 1: {3}}, 1, 0, 0).startswith("no snapshot step is held by every rank")


def test_restore_plan_counts_a_lost_nodes_ranks_at_the_steps_its_group_can_rebuild():
    full = {0: holdings({0: [20, 30]}, [20, 30]), 1: holdings({1: []}, []), 2: holdings({2: [20, 30]}, [20])}
    # group of 3, m = 1: node 1 needs 2 complete others; only step 20 has parity on both
    assert plan_restore(full, 3, 1) == RestorePlan(20, {1: [0, 2]}, "parity")
    # without erasure coding nothing can be rebuilt
    assert plan_restore(full, 1, 0) == RestorePlan(0, {}, "none")
    # m = 2 of 4: two lost nodes, two complete ones
    four = {0: holdings({0: [10]}, [10]), 1: holdings({1: []}, []), 2: holdings({2: []}, []),
            3: holdings({3: [10]}, [10])}
    assert plan_restore(four, 4, 2) == RestorePlan(10, {1: [0, 3], 2: [0, 3]}, "parity")
    assert plan_restore(four, 4, 1) == RestorePlan(0, {}, "none")  # more lost than parity covers
    # two groups of 2: the step must be restorable in both
    two = {0: holdings({0: [10, 20]}, [10, 20]), 1: holdings({1: []}, []),
           2: holdings({2: [10, 20]}, [10]), 3: holdings({3: [10, 20]}, [10])}
    assert plan_restore(two, 2, 1) == RestorePlan(20, {1: [0]}, "parity")
    # everyone holds its data: no rebuild, the newest step held by all
    assert plan_restore({0: holdings({0: [10, 20], 1: [10]}, [])}, 1, 0) == RestorePlan(10, {}, "ram")


def test_restore_plan_prefers_ram_and_parity_and_falls_back_to_disk_skipping_corrupt_steps():
    lost = {0: Holdings({0: {20}}, {20}, disk={10, 20}), 1: Holdings({1: set()}, set(), disk={10, 20})}
    assert plan_restore(lost, 2, 1) == RestorePlan(20, {1: [0]}, "parity")  # parity first, even if disk has it
    assert plan_restore(lost, 1, 0) == RestorePlan(20, {}, "disk")
    assert plan_restore(lost, 1, 0, frozenset({20})) == RestorePlan(10, {}, "disk")
    newer = {0: Holdings({0: {20}}, set(), disk={30}), 1: Holdings({1: {20}}, set(), disk={30})}
    assert plan_restore(newer, 1, 0) == RestorePlan(30, {}, "disk")  # a job resumed: disk is newer


def test_a_replacement_prepares_for_the_newest_step_enough_of_its_group_is_complete_for():
    complete = {0: {10, 20}, 2: {10}, 3: {10, 20}}
    assert rebuild_candidate(complete, 2) == (20, [0, 3])
    assert rebuild_candidate(complete, 3) == (10, [0, 2, 3])
    assert rebuild_candidate(complete, 4) == (0, [])
    assert rebuild_candidate({}, 1) == (0, [])


def test_holdings_round_trip_through_json():
    doc = Holdings({0: {10, 20}, 1: {20}}, {20}, "127.0.0.1:5000")
    assert Holdings.decode(doc.encode()) == doc and doc.steps == {20}


@pytest.mark.parametrize("backend", ["isa_l_rs_vand", "isa_l_rs_cauchy"])  # the XOR path and pyeclib's
def test_a_corrupt_parity_piece_is_never_used(backend):
    layout, codec = StripeLayout(3, 1, ALIGN), Codec(2, 1, backend)
    chunk_len = 3 * ALIGN
    data = os.urandom(2 * chunk_len)
    parity = bytearray(chunk_len)

    def fetch_into(i: int, offset: int, length: int, into: memoryview) -> None:
        source = memoryview(data)[i * chunk_len:] if i < 2 else memoryview(parity)
        into[:] = source[offset:offset + length]

    crcs = encode_parity(codec, layout, 0, 0, chunk_len, fetch_into, memoryview(parity))
    parity[ALIGN + 5] ^= 1  # piece 1
    out = bytearray(chunk_len)
    segments = [Segment(o, n, memoryview(out)[o:o + n]) for o, n in layout.pieces(chunk_len)]
    with pytest.raises(CorruptFragment, match="parity fragment 2, piece 1 .* fails its checksum"):
        rebuild_chunk(codec, layout, 0, chunk_len, [1, 2], fetch_into, segments,
                      lambda o, b: out.__setitem__(slice(o, o + len(b)), b), parity_crcs={2: crcs})


WRITE_AFTER_FAILURE = 2.0  # seconds a fetch in flight waits for the failed rebuild to return, then writes


@pytest.mark.timeout(60)
def test_a_failed_rebuild_returns_only_once_no_fetch_writes_into_the_slots():
    """A rebuild that fails on one piece (a survivor lost) had the next piece's fetches still in flight: they
    wrote into the slots after the keeper had abandoned them (emptied, their allocation stopped, a load or the next
    rebuild writing the same slots). Every fetch started has ended (or was cancelled before it ran) when the failure
    is raised."""
    layout, codec = StripeLayout(3, 1, ALIGN), Codec(2, 1, "isa_l_rs_vand")  # XOR path: fetched into the slot
    chunk_len = 3 * ALIGN
    out = bytearray(chunk_len)
    segments = [Segment(o, n, memoryview(out)[o:o + n]) for o, n in layout.pieces(chunk_len)]
    returned = threading.Event()
    late: list[int] = []  # the offsets of the pieces fetched into the slot after the failed first one

    def fetch_into(i: int, offset: int, length: int, into: memoryview) -> None:
        if offset == 0:
            if i == 2:
                raise ConnectionError("survivor lost")
            return
        returned.wait(WRITE_AFTER_FAILURE)  # a piece still in flight when the rebuild failed ...
        into[:] = b"x" * length  # ... writes into the slot here
        late.append(offset)

    with ThreadPoolExecutor(4) as pool:
        with pytest.raises(ConnectionError, match="survivor lost"):
            try:
                rebuild_chunk(codec, layout, 0, chunk_len, [1, 2], fetch_into, segments,
                              lambda o, b: out.__setitem__(slice(o, o + len(b)), b), pool)
            finally:
                written = list(late)  # when the failure came back
                returned.set()
    assert late == written, "fetches wrote into the slots after the rebuild failed"  # the pool has ended
    del segments


def test_rebuild_segments_never_cross_a_coding_piece():
    """A keeper's rebuild segments end at every slot file's end and at every piece, so each parity piece is checked
    whole (a segment across a piece would leave its checksum unchecked)."""
    writer = _BlobWriter.__new__(_BlobWriter)
    files = [mmap.mmap(-1, n) for n in (5 * ALIGN + 100, 9 * ALIGN)]
    writer.targets = [(0, 0, type("F", (), {"map": files[0]})(), 0, len(files[0])),
                      (1, 0, type("F", (), {"map": files[1]})(), len(files[0]), len(files[1]))]
    start, length, piece = 2 * ALIGN, 14 * ALIGN, 4 * ALIGN
    segments = writer.segments(start, length, piece)
    assert [(s.offset, s.length) for s in segments if s.into is not None] == [
        (0, 3 * ALIGN + 100), (3 * ALIGN + 100, ALIGN - 100), (4 * ALIGN, 4 * ALIGN), (8 * ALIGN, 4 * ALIGN),
        (12 * ALIGN, 100)]
    assert [(s.offset, s.length) for s in segments if s.into is None] == [(12 * ALIGN + 100, 2 * ALIGN - 100)]
    assert all(s.offset // piece == (s.offset + s.length - 1) // piece for s in segments)
    assert sum(s.length for s in segments) == length
    del segments


HEAP_PROBE = """
import resource, sys, threading
from ftrun.snapshot.erasure import PIECE, Codec
from ftrun.snapshot.heap import reuse_large_blocks
keep = sys.argv[1] == "keep"
if keep:
    assert reuse_large_blocks()
codec, length = Codec(4, 2), PIECE
pieces, into = {i: memoryview(bytearray(length)) for i in (1, 3, 4, 5)}, memoryview(bytearray(length))
faults = []
def code():
    for n in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        codec.reconstruct(pieces, 0, into)
        if n >= 2:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=code)
thread.start()
thread.join()
print(max(faults))
"""


def test_the_keepers_heap_keeps_pyeclibs_fragment_buffers():
    """pyeclib allocates and frees piece-sized fragments on every call; in a keeper's threads they are then
    faulted in afresh each time unless the heap keeps them (:func:`reuse_large_blocks`): page faults per call
    counted, in a process of its own (the setting is process-wide)."""
    import subprocess
    import sys

    env = {**os.environ, ENV_ISAL_LIBRARY: ""}  # pyeclib computes (ISA-L's kernels allocate nothing)
    faults = {how: int(subprocess.run([sys.executable, "-c", HEAP_PROBE, how], capture_output=True, text=True,
                                      check=True, timeout=60, env=env).stdout) for how in ("keep", "default")}
    # glibc's defaults fault in a whole fragment's pages per call here (2049 of a piece's 2048 measured); how many
    # depends on its version, so only the keeper's setting is asserted
    assert faults["keep"] < PIECE // 4096 // 4, faults
