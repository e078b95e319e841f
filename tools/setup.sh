#!/bin/sh
# Installs everything bmfs needs on a Debian machine (run as root): apt packages,
# a virtualenv in .venv with the Python dependencies, the `bmfs` command on PATH,
# the mount.fuse.bmfs helper and bash completion. It says what it does, a line per
# step, and ends with one line saying what it installed. A second run only checks:
# what is there already is left as it is (pip runs again only when pyproject.toml or
# native/ changed since the last install, or the install is broken).
#   tools/setup.sh          runtime dependencies
#   tools/setup.sh --test   also the test and benchmark dependencies (etcd, fio,
#                           JuiceFS and py-spy for tools/bench, ...)
set -eu
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MODE=runtime
[ "${1:-}" = "--test" ] && MODE=test
APT="python3 python3-venv python3-dev gcc pkg-config libfuse3-dev fuse3 \
     liberasurecode-dev libisal-dev libpmem1 attr procps ca-certificates"
[ "$MODE" = test ] && APT="$APT etcd-server fio rsync git tar stress-ng iproute2 psmisc \
  protobuf-compiler flatbuffers-compiler util-linux curl"
DONE=""  # what this run installed or changed
say() { echo "setup: $*"; }
did() { DONE="${DONE:+$DONE, }$*"; }

say "checking apt packages ($MODE)"
missing=""
for p in $APT; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  say "installing apt packages:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
  did "apt packages:$missing"
fi

if [ ! -x .venv/bin/python ]; then
  say "making the virtualenv $ROOT/.venv"
  /usr/bin/python3 -m venv .venv
  did "virtualenv .venv"
fi

# what the installed bmfs was installed from: pyproject.toml, native/ and the mode
STAMP=.venv/.bmfs-setup
want=$( (echo "$MODE $ROOT"; cat pyproject.toml native/*) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] &&
   .venv/bin/python -c "import bmfs.cli.main, pyfuse3, pyeclib, shtab" 2>/dev/null; then
  say "Python packages: bmfs and its dependencies are installed (unchanged)"
else
  say "installing bmfs and its Python dependencies into .venv (pip; builds native/)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  if [ "$MODE" = test ]; then
    .venv/bin/python -m pip install -q -e ".[test,bench]"
  else
    .venv/bin/python -m pip install -q -e .
  fi
  echo "$want" > "$STAMP"
  did "bmfs $(.venv/bin/python -c 'from importlib.metadata import version as v; print(v("bmfs"))') and its Python packages"
fi
# the C helpers (native/) are built by the install above; bmfs falls back to Python
# without them, so a failed build is a warning, not an error
.venv/bin/python -c "import bmfs.data._native, bmfs.node._native" 2>/dev/null ||
  echo "setup: warning: the C helper (native/) did not build; bmfs runs on its slower Python path" >&2

link() {  # link TARGET NAME: make NAME a link to TARGET unless it is one already
  if [ "$(readlink "$2" 2>/dev/null)" != "$1" ]; then
    say "linking $2 -> $1"
    ln -sf "$1" "$2"
    did "$2"
  fi
}
say "checking the bmfs command and the mount helper"
link "$ROOT/.venv/bin/bmfs" /usr/local/bin/bmfs
link "$ROOT/mount/mount.fuse.bmfs" /sbin/mount.fuse.bmfs
# (says where it went, or how to enable it where /etc/bash_completion.d is missing)
rc=0
tools/bash-completion.sh .venv/bin/python || rc=$?
[ "$rc" = 0 ] && did "bash completion"
[ "$rc" = 2 ] && echo "setup: warning: bmfs completion bash failed; no bash completion" >&2
# allow_other needs this line for non-root mounts; harmless for root.
if ! grep -qs '^user_allow_other' /etc/fuse.conf; then
  say "allowing allow_other in /etc/fuse.conf"
  echo user_allow_other >> /etc/fuse.conf
  did "user_allow_other in /etc/fuse.conf"
fi

if [ -n "$DONE" ]; then
  say "done: installed $DONE ($ROOT)"
else
  say "done: everything was installed already; nothing changed ($ROOT)"
fi
