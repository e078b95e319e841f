"""What the etcd engine's modules share about the JSON gateway: key encoding, the
engine-private keyspace and commit request ids (bmfs/kv/etcd.py explains them)."""
from __future__ import annotations

import base64
import os

RESERVED = b"\xff\xff\xff\xff"  # engine-private keys: every key >= RESERVED
REQ_PREFIX = RESERVED + b"r/"   # request ids of commits: REQ_PREFIX + 32 hex digits


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")  # the gateway omits empty values


def new_request_id() -> bytes:
    return REQ_PREFIX + os.urandom(16).hex().encode()
