#!/usr/bin/env bash
# The main job: `spartron train` on the tiny CPU preset (or the config given as first argument).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source scripts/venv.sh
exec spartron train "${1:-configs/tiny.toml}" "${@:2}"
