"""Who the etcd engine is to etcd: the endpoints, TLS client certificates and a user's
password, all named in the etcd URL; and what etcd's refusals mean.

The URL is ``etcd://HOST:PORT,HOST:PORT,...`` followed by options, e.g.::

    etcd://10.0.0.1:2379,10.0.0.2:2379?cacert=/etc/bmfs/etcd/ca.crt
        &cert=/etc/bmfs/etcd/client.crt&key=/etc/bmfs/etcd/client.key
        &user=root&password-file=/etc/bmfs/etcd/password

- ``cacert``: the CA the members' certificates are checked against; the engine then
  speaks https (and checks each member's name, the HOST of its endpoint).
- ``cert`` and ``key``: this client's certificate (mutual TLS, etcd's
  ``--client-cert-auth``).
- ``api``: ``grpc`` (the default) sends reads, transactions, leases and authentication
  over etcd's gRPC API (etcd_grpc.py), the rest through its JSON gateway; ``gateway``
  sends everything through the gateway.
- ``user`` and ``password-file``: an etcd user, and a file holding its password (its
  first line). The engine trades them for a token (``/v3/auth/authenticate``) sent in
  the ``Authorization`` header of every request, and trades them again when etcd says
  the token is no longer valid (etcd forgets a simple token unused for
  ``--auth-token-ttl``, 5 minutes by default; a JWT token expires after its TTL; a
  change of users or roles makes every token old).

Options name files, never secrets, so the URL can sit in volume.json and in a node's
argv: the key and the password stay in their files (keep them 0600). Paths must be
absolute (a volume directory is used from other working directories).
"""
from __future__ import annotations

import os
import socket
import ssl
import urllib.parse
from dataclasses import dataclass

from ..errors import Access

OPTIONS = ("cacert", "cert", "key", "user", "password-file", "api")
APIS = ("grpc", "gateway")  # api=: how requests go (etcd_grpc.py); grpc by default
# what ssl reports when the other side refused our certificate, or we refused its:
# a setting to fix, not an endpoint to fail over from
_TLS_REFUSALS = ("CERTIFICATE_VERIFY_FAILED", "CERTIFICATE_REQUIRED", "BAD_CERTIFICATE",
                 "UNKNOWN_CA", "CERTIFICATE_UNKNOWN", "WRONG_VERSION_NUMBER",
                 "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG")


@dataclass(frozen=True)
class EtcdAccess:
    """Where the members are and how to prove who we are (parsed from the URL)."""

    endpoints: tuple[str, ...]          # "https://host:port" or "http://host:port"
    tls: ssl.SSLContext | None          # None: plain http
    user: str | None
    password_file: str | None
    files: dict            # cacert=, cert=, key=: the files named (for the gRPC channels)
    api: str = "grpc"      # "grpc" or "gateway" (api= in the URL)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def password(self) -> str:
        """The user's password, read from its file now (it may be replaced while a
        mount runs).

        Raises:
            Access: the file cannot be read, or is empty.
        """
        try:
            with open(self.password_file, encoding="utf-8") as f:
                pw = f.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise Access(f"etcd: cannot read the password file {self.password_file}: "
                         f"{getattr(e, 'strerror', None) or e}") from None
        if not pw:
            raise Access(f"etcd: the password file {self.password_file} is empty")
        return pw


def parse_url(url: str) -> EtcdAccess:
    """The endpoints and credentials named by an etcd URL (see the module doc).

    Raises:
        ValueError: no endpoint, an unknown or repeated option, a relative path, a
            certificate without its key (or the reverse), a user without a password
            file (or the reverse).
        Access: a named file cannot be read or is not a certificate, key or CA.
    """
    rest = url.split("://", 1)[-1]
    hosts_part, _, query = rest.partition("?")
    hosts = [h for h in hosts_part.strip("/").split(",") if h]
    if not hosts:
        raise ValueError(f"etcd URL needs endpoints, e.g. etcd://10.0.0.1:2379,10.0.0.2:2379 "
                         f"(got {url!r})")
    opts: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True,
                                              strict_parsing=bool(query)):
        if name not in OPTIONS:
            raise ValueError(f"unknown etcd URL option {name!r} (known: {', '.join(OPTIONS)})")
        if name in opts:
            raise ValueError(f"etcd URL option {name!r} given twice")
        if name == "api" and value not in APIS:
            raise ValueError(f"etcd URL option api={value!r}: use one of {', '.join(APIS)}")
        if name not in ("user", "api") and not os.path.isabs(value):
            raise ValueError(f"etcd URL option {name} needs an absolute path (got {value!r})")
        opts[name] = value
    if ("cert" in opts) != ("key" in opts):
        raise ValueError("etcd URL: give cert= and key= together (the client certificate "
                         "and its key)")
    if ("user" in opts) != ("password-file" in opts):
        raise ValueError("etcd URL: give user= and password-file= together")
    if "cert" in opts and "cacert" not in opts:
        raise ValueError("etcd URL: a client certificate needs cacert= (the CA of the "
                         "members' certificates)")
    tls = _tls_context(opts) if "cacert" in opts else None
    scheme = "https" if tls is not None else "http"
    files = {k: opts[k] for k in ("cacert", "cert", "key") if k in opts}
    return EtcdAccess(tuple(f"{scheme}://{h}" for h in hosts), tls, opts.get("user"),
                      opts.get("password-file"), files, opts.get("api", "grpc"))


def _tls_context(opts: dict[str, str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    try:
        ctx.load_verify_locations(cafile=opts["cacert"])
    except (OSError, ssl.SSLError) as e:
        raise Access(f"etcd: cannot use the CA certificate {opts['cacert']}: "
                     f"{getattr(e, 'strerror', None) or e}") from None
    if "cert" in opts:
        try:
            ctx.load_cert_chain(opts["cert"], opts["key"])
        except (OSError, ssl.SSLError) as e:
            raise Access(f"etcd: cannot use the client certificate {opts['cert']} with "
                         f"key {opts['key']}: {getattr(e, 'strerror', None) or e}") from None
    return ctx


def diagnose_tls(access: EtcdAccess, endpoint: str, timeout: float = 1.0) -> str:
    """Why ``endpoint`` cannot be reached, if it is over TLS settings: it refuses our
    certificate (or we its), or it speaks https and the URL names no CA. "" if not.
    Blocking (run it in a thread): the async stack reports a refused certificate as a
    connection that broke, without the reason."""
    host, _, port = endpoint.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")
    if access.tls is None:  # does it speak TLS? (no check of its certificate: a probe)
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx = access.tls
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                if access.tls is None:
                    return (f"etcd {endpoint} speaks https: give cacert= (and cert=, key= "
                            "if it checks client certificates) in the etcd URL")
                s.sendall(b"GET /version HTTP/1.0\r\n\r\n")
                s.recv(1)  # (TLS 1.3: the server's verdict on our certificate comes now)
    except ssl.SSLError as e:
        why = tls_refusal(e)
        if why and access.tls is not None:
            return (f"etcd {endpoint}: TLS refused: {why} (check cacert=, cert= and key= "
                    "in the etcd URL)")
    except (OSError, ValueError):
        pass
    return ""


def tls_refusal(e: BaseException) -> str:
    """What a TLS failure in ``e``'s causes says, if it is a refusal of certificates
    (not a dropped connection); "" otherwise."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ssl.SSLError):
            text = f"{getattr(e, 'reason', '') or ''} {e}"
            return str(e) if any(r in text for r in _TLS_REFUSALS) else ""
        e = e.__cause__ or e.__context__
        seen += 1
    return ""


def refusal(msg: str, access: EtcdAccess) -> Access | None:
    """The error for etcd's answer ``msg`` if it refuses who we are (None if not)."""
    no_user = access.user is None and ("user name is empty" in msg
                                       or "permission denied" in msg)
    if no_user:  # (through the gateway, etcd says either)
        return Access(f"etcd requires authentication ({msg}): give user= and "
                      "password-file= in the etcd URL (docs/etcd.md)")
    if "authentication failed" in msg:
        return Access(f"etcd refused user {access.user!r}: {msg} (the password is the "
                      f"first line of {access.password_file})")
    if "permission denied" in msg:
        return Access(f"etcd: user {access.user!r} may not do this: {msg} (bmfs needs a "
                      "user with the root role)")
    return None


def token_expired(msg: str) -> bool:
    """Whether etcd's answer says to authenticate again (the token expired, the member
    restarted, or users or roles changed since it was issued)."""
    return "invalid auth token" in msg or "revision of auth store is old" in msg
