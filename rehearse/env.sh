#!/bin/sh
# The AReaL environment of `make rehearse` and `make test`; prints its python. rehearse/build.sh builds it once
# (AReaL, SGLang, a CPU torch: minutes) and caches it, keyed by its pin files and its own text; podkit's own tools
# (tools.txt) then go into it once per change of tools.txt, in seconds: a new tool is no rebuild of the rest.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=$(sh "$here/build.sh")
venv=$(dirname "$(dirname "$python")")
stamp="$venv/.tools-$(sha256sum <"$here/tools.txt" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  exec 9>"$venv/.tools.lock"
  flock 9
  if [ ! -f "$stamp" ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$here/tools.txt" >&2
    touch "$stamp"
  fi
fi
echo "$python"
