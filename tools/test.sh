#!/bin/sh
# Installs everything (apt packages, venv, test tools) and runs the whole test suite.
set -eu
cd "$(dirname "$0")/.."
tools/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests
