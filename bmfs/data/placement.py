"""Placement: which devices hold a stripe's fragments.

Rendezvous (highest random weight) hashing of (stripe id, device id): every stripe
gets k+m distinct devices, load spreads evenly, and adding or removing a device
moves only the fragments that must move. The chosen device of each fragment is
recorded in the stripe record, so repair can move fragments without rehashing.
"""
from __future__ import annotations

import hashlib


def _weight(sid: int, dev: int) -> bytes:
    return hashlib.blake2b(b"%d:%d" % (sid, dev), digest_size=8).digest()


def place(sid: int, devices: list[int], n: int) -> list[int]:
    if len(devices) == n:
        # common single-machine case: rotate so parity is spread over all devices
        r = sid % n
        return devices[r:] + devices[:r]
    if len(devices) < n:
        raise ValueError(f"{n} fragments need {n} devices, only {len(devices)} known")
    return sorted(devices, key=lambda d: _weight(sid, d), reverse=True)[:n]


def place_available(sid: int, devices: list[int], n: int) -> list[int]:
    """Like place, but with fewer than n devices some hold two fragments (spread later
    by repair): a write still stores every fragment while nodes are down."""
    if len(devices) >= n:
        return place(sid, devices, n)
    ranked = sorted(devices, key=lambda d: _weight(sid, d), reverse=True)
    return [ranked[i % len(ranked)] for i in range(n)]
