#!/usr/bin/env sh
# Debian/Ubuntu packages uag uses when they can be installed: OpenBLAS (fast fp32 CPU matmuls for MLX
# on Linux) and, with "test", Chromium for the browser test. Elsewhere (macOS) there is nothing to do.
set -eu
packages="libopenblas0-pthread"
[ "${1:-}" = "test" ] && packages="$packages chromium chromium-driver"

command -v apt-get >/dev/null 2>&1 || exit 0
missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
[ -n "$missing" ] || exit 0

if [ "$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "uag: please install these Debian packages:$missing  (sudo apt-get install$missing)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q $missing >/dev/null 2>&1 || {
    $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q $missing >/dev/null
}
echo "uag: installed$missing" >&2
