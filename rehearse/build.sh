#!/bin/sh
# Builds (once) the AReaL environment: AReaL's real trainer and SGLang's and AReaL's real parsers on a
# CPU torch, kept apart from podkit's own venv and cached outside the clone, keyed by this directory's
# pin files, so CI on the same machine reuses it. Prints its python. `make rehearse` and `make test`
# use it. ~4 minutes and ~3.3 GB the first time (bench/RESULTS.md).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
key=$(cat "$here/requirements.txt" "$here/deps.txt" "$here/constraints.txt" "$0" | sha256sum | cut -c1-12)
root=${PODKIT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/podkit}
venv=$root/areal-$key
if [ ! -f "$venv/.ready" ]; then
  mkdir -p "$root"
  exec 9>"$root/areal-env.lock"
  flock 9
  if [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    echo "building the AReaL environment in $venv (once; minutes)" >&2
    "$python" -m venv "$venv"
    pip="$venv/bin/pip install -q --disable-pip-version-check"
    $pip torch==2.13.0 >&2
    # Without their dependency trees: areal's and sglang's pull CUDA builds of torch and friends.
    $pip --no-deps -r "$here/requirements.txt" >&2
    $pip -c "$here/constraints.txt" -r "$here/deps.txt" >&2
    touch "$venv/.ready"
  fi
fi
echo "$venv/bin/python"
