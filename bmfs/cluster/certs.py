"""Certificates for a cluster on this machine: a private CA and certificates it signs,
made with the ``openssl`` command (Debian's, installed with ca-certificates).

``make_ca_and_certs(directory, names)`` writes, in ``directory`` (mode 0700):

- ``ca.crt`` (the CA certificate, to trust) and ``ca.key`` (its key: whoever holds it
  can make more certificates; it is kept only to add members later);
- for each name, ``NAME.crt`` and ``NAME.key``: a certificate for subject
  ``O=bmfs, OU=NAME``, valid for loopback (``IP:127.0.0.1``, ``DNS:localhost``, plus
  ``hosts``) and usable both to serve and as a client (etcd members use one
  certificate for client and peer connections, and their JSON gateway dials the member
  with it). It has no common name: with authentication on, etcd's gateway refuses a
  client certificate that has one ("CommonName of client sending a request against
  gateway will be ignored"); names are checked against the subjectAltName anyway.

Keys are EC P-256, created 0600 (the process umask is 077 while openssl runs), and
never pass through argv or the environment. A production cluster uses certificates
from its own CA instead (docs/deploy.md).
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess

from ..errors import VolumeError

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
DAYS = 3650
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(directory: str, *args: str, stdin: bytes | None = None) -> None:
    try:
        subprocess.run([OPENSSL, *args], cwd=directory, input=stdin, check=True,
                       capture_output=True, umask=0o077)
    except FileNotFoundError:
        raise VolumeError(f"openssl is not installed ({OPENSSL}); install the openssl "
                          "package to make certificates") from None
    except subprocess.CalledProcessError as e:
        err = e.stderr.decode(errors="replace").strip().splitlines()
        raise VolumeError(f"openssl {args[0]} failed: {err[-1] if err else e}") from None


def make_ca_and_certs(directory: str, names: list[str],
                      hosts: tuple[str, ...] = ()) -> dict[str, tuple[str, str]]:
    """Make a CA (unless ``directory`` has one) and a certificate for each name.

    ``hosts``: more names (DNS) or addresses (IP) every certificate is valid for.
    Returns ``{"ca": (ca.crt, ca.key), NAME: (NAME.crt, NAME.key), ...}`` (paths). A
    name whose certificate and key are there already keeps them.

    Raises:
        VolumeError: openssl is missing or failed.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    out = {"ca": (os.path.join(directory, "ca.crt"), os.path.join(directory, "ca.key"))}
    if not os.path.exists(out["ca"][0]):
        _openssl(directory, "req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", str(DAYS), "-subj", "/CN=bmfs cluster CA",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    alt = ["IP:127.0.0.1", "DNS:localhost"]
    for h in hosts:
        alt.append(("IP:" if h.replace(".", "").isdigit() or ":" in h else "DNS:") + h)
    ext = (f"subjectAltName={','.join(dict.fromkeys(alt))}\n"
           "keyUsage=critical,digitalSignature,keyEncipherment\n"
           "extendedKeyUsage=serverAuth,clientAuth\n").encode()
    for name in names:
        crt, key = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
        out[name] = (crt, key)
        if os.path.exists(crt) and os.path.exists(key):
            continue  # made before (a member added later keeps the others' as they are)
        csr = f"{name}.csr"
        _openssl(directory, "req", "-new", *_KEY, "-keyout", f"{name}.key", "-out", csr,
                 "-subj", f"/O=bmfs/OU={name}")
        try:
            _openssl(directory, "x509", "-req", "-in", csr, "-CA", "ca.crt", "-CAkey", "ca.key",
                     "-set_serial", "0x" + secrets.token_hex(16), "-days", str(DAYS),
                     "-out", f"{name}.crt", "-extfile", "/dev/stdin", stdin=ext)
        finally:
            os.unlink(os.path.join(directory, csr))
    return out


def member_files(made: dict[str, tuple[str, str]], name: str) -> dict[str, str]:
    """One member's files from what make_ca_and_certs returned: {"cert", "key", "ca"}
    (the shape of a volume's or a node's ``tls`` settings)."""
    crt, key = made[name]
    return {"cert": crt, "key": key, "ca": made["ca"][0]}
