"""ISA-L's GF(2^8) kernels for pyeclib's Reed-Solomon codes: the same bytes, without pyeclib's copies or the GIL.

Every fragment that a Reed-Solomon code computes (a parity fragment from the data, a lost fragment from any k
others, one source's *term* of it) is a linear combination of its source fragments over GF(2^8), byte by byte:
``out = c_0 * f_0 + ... + c_{k-1} * f_{k-1}``. pyeclib computes it by copying each fragment behind an 80-byte
header into a new ``bytes``, coding, and copying the result out, holding the GIL throughout. ISA-L, the library
that pyeclib's ``isa_l_*`` backends run on and whose build its wheel ships, computes such a combination over the
caller's buffers in one call (``ec_encode_data``; ``ec_encode_data_update`` adds one source's term into a buffer),
at memory speed, and ctypes releases the GIL during it.

The coefficients come from pyeclib, never from arithmetic here: for each source, pyeclib's own output with that
source holding every byte value 0..255 in turn and the other sources zero is that source's term of every byte
value; its byte at value 1 is the coefficient. :class:`Combination` checks the kernel against all of those
bytes before it is used (a code over another representation of GF(2^8) fails the check), and the caller keeps
pyeclib for a combination that fails it, or when ISA-L's library is not found (:func:`load_isal`): pyeclib defines
the code, ISA-L only does its arithmetic.

Invariant: a :class:`Combination` gives exactly pyeclib's bytes for every input; it reads its sources and writes
only ``into``, from any number of threads at once (its tables are read only).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
import pyeclib

Buffer = bytes | bytearray | memoryview
TABLE_BYTES = 32  # ISA-L's multiplication tables per coefficient (ec_init_tables)
PROBE = bytes(range(256)) * 16  # every byte value, 4096 bytes: a source's probe when coefficients are learned
CALL_BYTES = 1 << 30  # bytes per ISA-L call at most (its lengths are C ints)
ENV_ISAL_LIBRARY = "FTRUN_ISAL_LIBRARY"  # a path to libisal (tests); "" turns the kernels off (pyeclib computes)

_Pointers = ctypes.POINTER(ctypes.c_void_p)


@cache
def load_isal() -> ctypes.CDLL | None:
    """ISA-L's shared library (:data:`ENV_ISAL_LIBRARY`, else the copy in pyeclib's wheel, else the system's),
    with its erasure-code functions typed; None when none is found or loads."""
    chosen = os.environ.get(ENV_ISAL_LIBRARY)
    if chosen is not None:
        candidates = [chosen] if chosen else []
    else:  # the wheel's libraries are beside its package
        wheel = os.path.join(os.path.dirname(os.path.dirname(pyeclib.__file__)), "pyeclib.libs")
        candidates = sorted(glob.glob(os.path.join(wheel, "libisal*.so*")))
        candidates += [name for name in [ctypes.util.find_library("isal")] if name]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            init, encode, update = lib.ec_init_tables, lib.ec_encode_data, lib.ec_encode_data_update
        except (OSError, AttributeError):
            continue
        init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        encode.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, _Pointers, _Pointers]
        update.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                           _Pointers]
        for function in (init, encode, update):
            function.restype = None
        return lib
    return None


def _address(buffer: Buffer) -> int:
    """The address of ``buffer``'s first byte (read-only buffers too; the caller keeps ``buffer`` alive)."""
    return int(np.frombuffer(buffer, np.uint8).ctypes.data) if len(buffer) else 0


class Combination:
    """``into = sum(c_i * source_i)`` over GF(2^8), or ``into ^= c * source`` (:meth:`add`), by ISA-L with the
    coefficients ``c``: one call, no copies, the GIL released. Lengths may be any number of bytes."""

    def __init__(self, lib: ctypes.CDLL, coefficients: Sequence[int]) -> None:
        if not coefficients or any(not 0 <= c < 256 for c in coefficients):
            raise ValueError(f"coefficients {list(coefficients)}: expected 1 or more bytes")
        self._lib, self.coefficients = lib, tuple(coefficients)
        self._tables = ctypes.create_string_buffer(TABLE_BYTES * len(coefficients))
        matrix = ctypes.create_string_buffer(bytes(coefficients), len(coefficients))
        lib.ec_init_tables(len(coefficients), 1, matrix, self._tables)

    @classmethod
    def learned(cls, lib: ctypes.CDLL, pyeclib_combination: Callable[[int, Buffer], bytes],
                count: int) -> Combination | None:
        """The combination of ``count`` sources whose term of source ``i`` on ``data`` pyeclib computes as
        ``pyeclib_combination(i, data)`` (``len(data)`` bytes, the other sources zero), each coefficient checked
        against pyeclib on every byte value; None when ISA-L's kernel gives other bytes."""
        terms = [pyeclib_combination(i, PROBE) for i in range(count)]
        combination = cls(lib, [term[1] for term in terms])
        for i, term in enumerate(terms):
            out = bytearray(len(PROBE))
            combination.add(i, PROBE, memoryview(out))
            if out != term:
                return None
        return combination

    def __call__(self, sources: Sequence[Buffer], into: memoryview) -> None:
        """``into = sum(c_i * sources[i])`` (each source ``len(into)`` bytes)."""
        count, length = len(self.coefficients), len(into)
        if len(sources) != count or any(len(source) != length for source in sources):
            raise ValueError(f"need {count} sources of {length} bytes, got {[len(s) for s in sources]}")
        for start in range(0, length, CALL_BYTES):
            n = min(CALL_BYTES, length - start)
            data = (ctypes.c_void_p * count)(*(_address(source) + start for source in sources))
            out = (ctypes.c_void_p * 1)(_address(into) + start)
            self._lib.ec_encode_data(n, count, 1, self._tables, data, out)

    def add(self, index: int, source: Buffer, into: memoryview) -> None:
        """``into ^= c_index * source`` (``len(into)`` bytes): source ``index``'s term added in."""
        if len(source) != len(into) or not 0 <= index < len(self.coefficients):
            raise ValueError(f"source {index} of {len(self.coefficients)}: {len(source)} bytes for {len(into)}")
        for start in range(0, len(into), CALL_BYTES):
            n = min(CALL_BYTES, len(into) - start)
            out = (ctypes.c_void_p * 1)(_address(into) + start)
            self._lib.ec_encode_data_update(n, len(self.coefficients), 1, index, self._tables,
                                            ctypes.c_void_p(_address(source) + start), out)
