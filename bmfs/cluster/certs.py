"""A cluster CA and certificates signed by it, made with the `openssl` command line.

For test clusters (`bmfs cluster up --tls`) and small deployments: a real cluster may
point at the CA it has instead (docs/deploy.md). Every certificate serves as server
and as client (extendedKeyUsage both), names its CN and, for local use, localhost and
127.0.0.1. Keys are EC P-256 and written 0600 in a 0700 directory; the CA key stays
there, so whoever can read it can make members: keep the directory root's.
"""
from __future__ import annotations

import os
import subprocess

from ..errors import VolumeError

DAYS = "3650"
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(args: list[str], cwd: str) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, umask=0o077,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise VolumeError("making TLS certificates needs the openssl command "
                          "(Debian: apt-get install openssl)") from None
    except subprocess.CalledProcessError as e:
        raise VolumeError(f"openssl {args[0]} failed: "
                          f"{e.stderr.decode(errors='replace').strip()}") from None


def make_ca_and_certs(directory: str, names: list[str]) -> dict[str, dict[str, str]]:
    """Make ``directory`` (0700) hold a CA (ca.pem, ca.key) and, for each name, NAME.pem
    and NAME.key signed by it; what is there already is kept (a CA made before signs
    the new names). Returns {name: {"cert", "key", "ca"}} (absolute paths).

    Raises:
        VolumeError: openssl is missing or failed (its message).
        ValueError: a name that is not a plain file name.
    """
    directory = os.path.abspath(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    ca, ca_key = os.path.join(directory, "ca.pem"), os.path.join(directory, "ca.key")
    if not os.path.exists(ca):
        _openssl(["req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.pem",
                  "-days", DAYS, "-subj", "/CN=bmfs cluster CA"], directory)
    out = {}
    for name in names:
        if not name or "/" in name or name.startswith(".") or name == "ca":
            raise ValueError(f"not a certificate name: {name!r}")
        cert, key = os.path.join(directory, name + ".pem"), os.path.join(directory, name + ".key")
        if not os.path.exists(cert):
            ext = os.path.join(directory, name + ".ext")
            with open(ext, "w") as f:
                f.write("basicConstraints=CA:FALSE\n"
                        "keyUsage=digitalSignature,keyEncipherment\n"
                        "extendedKeyUsage=serverAuth,clientAuth\n"
                        f"subjectAltName=DNS:{name},DNS:localhost,IP:127.0.0.1\n")
            try:
                _openssl(["req", "-new", *_KEY, "-keyout", name + ".key", "-out",
                          name + ".csr", "-subj", f"/CN={name}"], directory)
                _openssl(["x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey",
                          "ca.key", "-set_serial", "0x" + os.urandom(16).hex(), "-days",
                          DAYS, "-extfile", name + ".ext", "-out", name + ".pem"], directory)
            finally:
                for tmp in (ext, os.path.join(directory, name + ".csr")):
                    if os.path.exists(tmp):
                        os.remove(tmp)
        for path in (key, cert, ca_key, ca):
            os.chmod(path, 0o600)
        out[name] = {"cert": cert, "key": key, "ca": ca}
    return out
