#!/bin/sh
# System packages the test suite needs: Debian's chromium for the browser tests
# (tests/browser/, launched at /usr/bin/chromium; no Playwright browser download).
# Idempotent and quiet; runs as root (or through sudo) with no terminal.
set -eu

PACKAGES="chromium"

missing=""
for pkg in $PACKAGES; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $pkg"
    fi
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1; then
    as_root="sudo -n"
else
    echo "system-deps: need root to install:$missing" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
$as_root apt-get update -qq </dev/null >/dev/null
# shellcheck disable=SC2086  # word splitting of the package list is intended
$as_root apt-get install -y -qq $missing </dev/null >/dev/null
test -x /usr/bin/chromium
