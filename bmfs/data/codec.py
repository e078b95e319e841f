"""Erasure codec: ISA-L Reed-Solomon (Vandermonde), pyeclib's ``isa_l_rs_vand``.

The code is systematic: data fragment i carries bytes [i*B, (i+1)*B) of the stripe
after liberasurecode's own 80-byte fragment header, where B = fragment length - 80. A
healthy read therefore needs no decode and can read a byte range of a single fragment.

Encoding runs in the C helper (bmfs/native.py) when it is built: the same bytes
as pyeclib, with the GIL released, so a stripe is encoded in a worker thread while
the event loop goes on serving FUSE (pyeclib holds the GIL for the whole encode).
liberasurecode's 80-byte headers depend only on the stripe's length (no checksum
type is set), so they are taken from one pyeclib encode per length and reused.
Rebuilding missing data fragments for a degraded read runs in C too (``rs_rebuild``:
invert the survivors' rows of the encode matrix, apply the missing rows); full
decodes stay with pyeclib.
"""
from __future__ import annotations

import functools

from pyeclib.ec_iface import ECDriver

from ..format.fragment import LIB_HEADER
from ..native import NATIVE

EC_TYPE = "isa_l_rs_vand"
HEADER_CACHE = 1024  # stripe lengths whose liberasurecode headers are kept


def stripe_length(data) -> int:
    """The length of a stripe given as a bytes-like object or a list of pieces."""
    return sum(map(len, data)) if isinstance(data, list) else len(data)


def stripe_bytes(data) -> bytes:
    """A stripe given as a bytes-like object or a list of pieces, as one bytes."""
    if isinstance(data, list):
        return b"".join(data)
    return data if isinstance(data, bytes) else bytes(data)


class Codec:
    def __init__(self, k: int, m: int, native=NATIVE):
        self.k, self.m = k, m
        self._driver = ECDriver(k=k, m=m, ec_type=EC_TYPE)
        self._native = native
        # stripe length -> (fragment payload length, the k+m liberasurecode headers)
        self._headers: dict[int, tuple[int, bytes]] = {}

    def encode(self, data) -> list[bytes]:
        """k+m fragments of equal length; fragments 0..k-1 hold the data in order.
        ``data``: a bytes-like object, or a list of them (the stripe's pieces, in order:
        the C path reads them where they are, nothing joins them first). Thread-safe;
        the C path does not hold the GIL while it works."""
        length = stripe_length(data)
        known = self._headers.get(length) if self._native is not None else None
        if known is None:
            frags = self._driver.encode(stripe_bytes(data))
            if self._native is not None:
                if len(self._headers) >= HEADER_CACHE:
                    self._headers.clear()
                self._headers[length] = (len(frags[0]) - LIB_HEADER,
                                         b"".join(f[:LIB_HEADER] for f in frags))
            return frags
        payload, headers = known
        return self._native.rs_encode(self.k, self.m, data, payload, headers)

    def decode(self, fragments: list[bytes]) -> bytes:
        """The stripe's data from any k intact fragments (their headers say which)."""
        return self._driver.decode(fragments)

    def rebuild_data(self, fragments: dict, missing: list[int]) -> list:
        """The payloads (no header) of the data fragments ``missing`` (indexes < k), from
        ``fragments``: index -> whole fragment, at least k of them. Thread-safe; the C
        path (rs_rebuild) does not hold the GIL, copies nothing it does not return and
        allocates no whole fragment."""
        if self._native is not None:
            survivors = sorted(fragments.items())[:self.k]
            payload = len(survivors[0][1]) - LIB_HEADER
            try:
                return self._native.rs_rebuild(self.k, self.m, payload, survivors, missing)
            except ValueError:
                pass  # singular (DataClient passes k that are not, see _pick): pyeclib says so
        frags = [bytes(f) for _, f in sorted(fragments.items())]  # pyeclib takes bytes only
        return [memoryview(f)[LIB_HEADER:] for f in self._driver.reconstruct(frags, missing)]

    def rebuild_range(self, fragments: dict, missing: list[int], start: int, end: int,
                      length: int) -> list:
        """Bytes [start, end) (fragment offsets, ``start`` >= LIB_HEADER) of the data
        fragments ``missing``, from ``fragments``: index -> fragment (from its start,
        at least ``end`` bytes), exactly k that determine the stripe of ``length``
        bytes. Only their bytes in [start, end) are used: elsewhere they may be bad, and
        so may their liberasurecode headers (pyeclib is given the ones an encode of
        ``length`` bytes makes). Thread-safe."""
        chosen = sorted(fragments.items())
        if self._native is not None:  # rs_rebuild reads the survivors' payloads from
            # LIB_HEADER on: the range, behind the bytes before it as a stand-in header
            survivors = [(i, memoryview(f)[start - LIB_HEADER:end]) for i, f in chosen]
            try:
                return self._native.rs_rebuild(self.k, self.m, end - start, survivors, missing)
            except ValueError:
                pass  # singular: pyeclib says so
        payload, headers = self._lib_headers(length)
        frags = [headers[i * LIB_HEADER:(i + 1) * LIB_HEADER]
                 + bytes(memoryview(f)[LIB_HEADER:]).ljust(payload, b"\0") for i, f in chosen]
        return [memoryview(f)[start:end] for f in self._driver.reconstruct(frags, missing)]

    def _lib_headers(self, length: int) -> tuple[int, bytes]:
        """(fragment payload length, the k+m liberasurecode headers) of a stripe of
        ``length`` bytes."""
        known = self._headers.get(length)
        if known is None:
            frags = self._driver.encode(bytes(length))
            if len(self._headers) >= HEADER_CACHE:
                self._headers.clear()
            known = self._headers[length] = (len(frags[0]) - LIB_HEADER,
                                             b"".join(f[:LIB_HEADER] for f in frags))
        return known

    def fragment_length(self, data_length: int) -> int:
        info = self._driver.get_segment_info(data_length, max(data_length, 1))
        return info["fragment_size"]


@functools.lru_cache(maxsize=8)
def codec(k: int, m: int) -> Codec:
    return Codec(k, m)
