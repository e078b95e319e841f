"""Erasure codec: pyeclib (ISA-L Reed-Solomon, Vandermonde) behind a small interface.

The code is systematic: data fragment i carries bytes [i*B, (i+1)*B) of the stripe
after pyeclib's own 80-byte fragment header, where B = fragment length - 80. A healthy
read therefore needs no decode and can read a byte range of a single fragment.
"""
from __future__ import annotations

import functools

from pyeclib.ec_iface import ECDriver

LIB_HEADER = 80  # liberasurecode's per-fragment header
EC_TYPE = "isa_l_rs_vand"


class Codec:
    def __init__(self, k: int, m: int):
        self.k, self.m = k, m
        self._driver = ECDriver(k=k, m=m, ec_type=EC_TYPE)

    def encode(self, data) -> list[bytes]:
        """k+m fragments of equal length; fragments 0..k-1 hold the data in order."""
        return self._driver.encode(bytes(data) if not isinstance(data, bytes) else data)

    def decode(self, fragments: list[bytes]) -> bytes:
        """The stripe's data from any k intact fragments (their headers say which)."""
        return self._driver.decode(fragments)

    def fragment_length(self, data_length: int) -> int:
        info = self._driver.get_segment_info(data_length, max(data_length, 1))
        return info["fragment_size"]


@functools.lru_cache(maxsize=8)
def codec(k: int, m: int) -> Codec:
    return Codec(k, m)
