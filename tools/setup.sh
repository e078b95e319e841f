#!/bin/sh
# Installs everything bmfs needs on a Debian machine (run as root): apt packages,
# a virtualenv in .venv with the Python dependencies, the `bmfs` command on PATH
# and the mount.fuse.bmfs helper. Idempotent: a second run only checks.
#   tools/setup.sh          runtime dependencies
#   tools/setup.sh --test   also the test and benchmark dependencies (etcd, fio,
#                           JuiceFS and py-spy for tools/bench, ...)
set -eu
cd "$(dirname "$0")/.."
ROOT=$(pwd)
APT="python3 python3-venv python3-dev gcc pkg-config libfuse3-dev fuse3 \
     liberasurecode-dev libisal-dev libpmem1 attr procps ca-certificates"
[ "${1:-}" = "--test" ] && APT="$APT etcd-server fio rsync git tar stress-ng iproute2 psmisc \
  protobuf-compiler flatbuffers-compiler util-linux curl"
missing=""
for p in $APT; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e ".[test,bench]"
else
  .venv/bin/python -m pip install -q -e .
fi
# the C helpers (native/) are built by the install above; bmfs falls back to Python
# without them, so a failed build is a warning, not an error
.venv/bin/python -c "import bmfs.data._native, bmfs.node._native" 2>/dev/null ||
  echo "setup: warning: the C helper (native/) did not build; bmfs runs on its slower Python path" >&2
ln -sf "$ROOT/.venv/bin/bmfs" /usr/local/bin/bmfs
ln -sf "$ROOT/mount/mount.fuse.bmfs" /sbin/mount.fuse.bmfs
# allow_other needs this line for non-root mounts; harmless for root.
grep -qs '^user_allow_other' /etc/fuse.conf || echo user_allow_other >> /etc/fuse.conf
