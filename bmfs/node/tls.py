"""TLS for node connections (optional): mutual certificates of one cluster CA.

Caveats first:
- Any certificate the CA signed is taken as a member of the cluster, node or client
  alike; host names are not checked (nodes are reached by address, and certificates
  made by `bmfs cluster up` name no host). Give the cluster a CA of its own.
- The HMAC handshake of the cluster secret still runs inside TLS: a peer needs both.
- A TLS connection is served on the Python paths only: the C fast paths (a node's
  small READs, native/node_reads.c; the mount's, native/client_reads.c) and sendfile
  write to the raw socket, which would bypass the encryption.

The stdlib's ``ssl.SSLSocket`` is used, not ``trio.SSLStream``: the framing of
protocol.py works on the socket itself (trio's ``wait_readable`` on its descriptor,
blocking receives in a node's connection threads), and an SSLSocket fits both.
"""
from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass

import trio


@dataclass(frozen=True)
class TlsConfig:
    """Certificate, key (PEM files) and the cluster CA that signed every member's."""
    cert: str
    key: str
    ca: str

    @classmethod
    def from_json(cls, d: dict, base: str) -> "TlsConfig":
        """The ``tls`` section of volume.json (paths relative to ``base``, the volume
        directory). Raises ValueError on missing or unknown keys."""
        if not isinstance(d, dict) or set(d) != {"cert", "key", "ca"}:
            raise ValueError("the tls section wants exactly cert, key and ca (paths)")
        return cls(**{k: os.path.join(base, v) for k, v in d.items()})

    def context(self, server: bool) -> ssl.SSLContext:
        """An SSL context that presents our certificate and requires the peer's, signed
        by the CA. Raises OSError/ssl.SSLError if the files cannot be used."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        return ctx


async def wrap(sock: socket.socket, ctx: ssl.SSLContext, server: bool) -> ssl.SSLSocket:
    """``sock`` (a non-blocking stdlib socket, connected) after a TLS handshake, as a
    non-blocking SSLSocket (which owns the descriptor from now on: it is closed here
    if this raises: ssl.SSLError when the peer is no member, OSError, or the caller's
    cancellation, which bounds the time)."""
    tls = ctx.wrap_socket(sock, server_side=server, do_handshake_on_connect=False)
    try:
        while True:
            try:
                tls.do_handshake()
                return tls
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(tls)
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(tls)
    except BaseException:
        tls.close()
        raise
