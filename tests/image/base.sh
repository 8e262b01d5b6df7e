#!/bin/sh
# Builds the CPU base image the project's Dockerfile is tested on (it stands where the SGLang image
# stands on a GPU build): Debian bookworm from debootstrap, with Python, pip, supervisor, and the CPU
# torch this machine's package index carries. No registry is reachable, so the base is made here, in
# one layer (docker import), and kept in the test engine's data root between runs.
#   tests/image/base.sh TAG      (DOCKER_HOST names the engine; needs root for debootstrap/chroot)
set -eu
tag=$1
if docker image inspect "$tag" >/dev/null 2>&1; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
debootstrap --variant=minbase --include=python3,python3-pip,git,psmisc,lsof,procps,ca-certificates \
  bookworm "$root" http://deb.debian.org/debian >&2
# Wheels through the host's pip: the CPU torch file is on this machine's disk, not on PyPI.
python3 -m pip download -q -d "$root/tmp/wheels" torch==2.13.0 numpy "supervisor>=4.2,<5" "PyYAML>=6,<7" >&2
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root chroot "$root" python3 -m pip install -q --break-system-packages --no-index --find-links /tmp/wheels \
  torch numpy supervisor PyYAML >&2
rm -rf "$root/tmp/wheels" "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
# pip and apt inside image builds reach the package index only with the host's CA bundle.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$tag" >&2
