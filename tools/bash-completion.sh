#!/bin/sh
# Installs bmfs's bash completion (tools/setup.sh runs it):
#   tools/bash-completion.sh PYTHON [DIR]
# writes PYTHON's `bmfs completion bash` to DIR/bmfs (DIR: /etc/bash_completion.d by
# default) when DIR exists, and says where it went and what makes shells read it.
# Without DIR it writes nothing and says how to enable completion instead.
# Exit status: 0 the file was written, 1 nothing changed, 2 an error.
set -eu
PY=$1
DIR=${2:-/etc/bash_completion.d}
say() { echo "setup: $*"; }
LOADER=/usr/share/bash-completion/bash_completion  # Debian's bash-completion package
if [ ! -d "$DIR" ]; then
  say "bash completion not installed: there is no $DIR (apt-get install" \
      "bash-completion, then run tools/setup.sh again; or add" \
      "'source <(bmfs completion bash)' to ~/.bashrc)"
  exit 1
fi
script=$("$PY" -m bmfs.cli.main completion bash) || exit 2
if [ "$(cat "$DIR/bmfs" 2>/dev/null)" = "$script" ]; then
  exit 1
fi
say "writing bash completion to $DIR/bmfs"
printf '%s\n' "$script" > "$DIR/bmfs"
if [ ! -f "$LOADER" ]; then
  say "bash reads $DIR/bmfs once the bash-completion package is installed" \
      "(apt-get install bash-completion; or add 'source $DIR/bmfs' to ~/.bashrc)"
fi
exit 0
