"""Authenticated values in the control store: every value ftrun writes carries an HMAC with the job secret.

A value is stored as ``payload + TAG_MARK + hex(HMAC-SHA256(k, SIGNED_LABEL + len(key) + key + payload))``
where ``k = HMAC-SHA256(job secret, STORE_LABEL)`` (a key of its own, separate from the keepers' handshake).
The MAC covers the key, so a signed value copied to another key does not verify there. The MAC is
deterministic: the same (key, payload) always seals to the same bytes, which is what compare-and-set needs.

Invariants:

- :meth:`SignedStore.get` and :meth:`SignedStore.multi_get` return payloads that some process holding the job
  secret wrote under exactly that key, or None. Only ftrun code of the job holds the secret (launcher,
  supervisors, ``ftrun status`` of the same user; never trainers), and it only writes well-formed values, so
  callers may decode an authentic payload without guarding against garbage.
- A value that is not authentic (no tag, truncated, a wrong MAC, not from this key) is treated as absent, never
  raises, and is reported once per key and process through the ``warn`` callback, naming the key (the store does
  not say who wrote it, so the sender is unknown).
- What authentication cannot stop: a replay of an older authentic value under the same key (callers that need
  monotonic values check it, see :meth:`ftrun.control.coordination.Coordinator.current_raw`), and overwriting or
  deleting a value, which can only delay the job or make it fail on a timeout (denial of service; the store's
  binding and the network are the defence there).

Nothing here imports torch: the wrapped store is a :class:`~ftrun.control.store.Store` (c10d or etcd).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ftrun.control.store import Store

STORE_LABEL = b"ftrun control store v1"
SIGNED_LABEL = b"ftrun value\x00"
TAG_MARK = b"\x00ftrun-hmac:"
_MAC_HEX = 64
TAG_LEN = len(TAG_MARK) + _MAC_HEX


def _stderr(message: str) -> None:
    print(f"ftrun: {message}", file=sys.stderr, flush=True)


class SignedStore:
    """A :class:`~ftrun.control.store.Store` (``raw``) whose values are sealed on write and verified on read; see the
    module doc.

    ``warned`` may be shared by several wrappers of one process (one warning per key per process)."""

    def __init__(self, store: Store, secret: str | bytes, warn: Callable[[str], None] | None = None,
                 warned: set[str] | None = None) -> None:
        if not secret:
            raise ValueError("the control store needs the job secret")
        raw_secret = secret.encode() if isinstance(secret, str) else secret
        self.raw = store
        self.poll_interval = store.poll_interval
        self._key = hmac.new(raw_secret, STORE_LABEL, hashlib.sha256).digest()
        self._warn = warn or _stderr
        self._warned = set() if warned is None else warned

    # -- sealing --------------------------------------------------------------------------------------------
    def _mac(self, key: str, payload: bytes) -> bytes:
        name = key.encode()
        message = SIGNED_LABEL + struct.pack("!Q", len(name)) + name + payload
        return hmac.new(self._key, message, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        """The bytes stored for ``value`` under ``key``."""
        payload = value.encode() if isinstance(value, str) else bytes(value)
        return payload + TAG_MARK + self._mac(key, payload)

    def open(self, key: str, raw: bytes | None) -> bytes | None:
        """The payload of ``raw`` (bytes read from ``key``) if it is authentic; None otherwise (warned once)."""
        if raw is None:
            return None
        raw = bytes(raw)
        if len(raw) < TAG_LEN or raw[-TAG_LEN:-_MAC_HEX] != TAG_MARK:
            self.warn_once(key, "not signed with the job secret" if raw else "empty, not signed")
            return None
        payload = raw[:-TAG_LEN]
        if not hmac.compare_digest(raw[-_MAC_HEX:], self._mac(key, payload)):
            self.warn_once(key, "bad signature (forged, tampered with, copied from another key, or written by a "
                           "node whose secret differs)")
            return None
        return payload

    def signed_otherwise(self, key: str, raw: bytes) -> bool:
        """Whether ``raw`` is sealed as ftrun seals values, but not for ``key`` with this secret (another node's
        secret, or a value copied from another key)."""
        raw = bytes(raw)
        return (len(raw) >= TAG_LEN and raw[-TAG_LEN:-_MAC_HEX] == TAG_MARK
                and not hmac.compare_digest(raw[-_MAC_HEX:], self._mac(key, raw[:-TAG_LEN])))

    def warn_once(self, key: str, why: str) -> None:
        """Report a value of ``key`` that was ignored, once per key."""
        if key not in self._warned:
            self._warned.add(key)
            self._warn(f"WARNING ignored the control-store value of {key}: {why} (sender unknown)")

    # -- the store interface ------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(key, self.seal(key, value))

    def get_raw(self, key: str) -> bytes | None:
        """The exact bytes stored under ``key`` (authentic or not), or None when it is not set; never blocks."""
        return self.raw.get_many([key])[0]

    def get(self, key: str) -> bytes | None:
        """The authentic payload of ``key``, or None (not set, or not authentic)."""
        return self.open(key, self.get_raw(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Payloads of ``keys`` (None: missing or not authentic), in one round trip where the store allows."""
        return [self.open(key, raw) for key, raw in zip(keys, self.raw.get_many(list(keys)))]

    def compare_set(self, key: str, expected: bytes, value: str | bytes) -> tuple[bool, bytes]:
        """Store ``value`` if ``key`` holds exactly the bytes ``expected`` (b"": not set). Returns whether this
        call stored it and the bytes ``key`` holds now."""
        sealed = self.seal(key, value)
        now = self.raw.compare_set(key, expected, sealed)
        return now == sealed, now

    def check(self, keys: Sequence[str]) -> bool:
        return self.raw.check(list(keys))
