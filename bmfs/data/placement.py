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


def place_available(sid: int, devices: list[int], n: int,
                    domains: dict[int, str] | None = None) -> list[int]:
    """Like place, but over failure domains and tolerant of missing devices.

    Fragments go to distinct failure domains first (a domain is a node, a rack...:
    the ``domain`` of each device record), then to distinct devices; with fewer than
    n devices some hold two fragments (spread later by repair), so a write still
    stores every fragment while nodes are down."""
    if not domains or len(set(domains.get(d, d) for d in devices)) >= len(devices):
        if len(devices) >= n:
            return place(sid, devices, n)
        ranked = sorted(devices, key=lambda d: _weight(sid, d), reverse=True)
        return [ranked[i % len(ranked)] for i in range(n)]
    ranked = sorted(devices, key=lambda d: _weight(sid, d), reverse=True)
    out: list[int] = []
    while len(out) < n:
        used = set()
        for d in ranked:  # one pass: at most one device per domain
            dom = domains.get(d, d)
            if d not in out and dom not in used and len(out) < n:
                out.append(d)
                used.add(dom)
        if not any(d not in out for d in ranked):  # every device used: double up
            out += ranked[:n - len(out)]
    return out
