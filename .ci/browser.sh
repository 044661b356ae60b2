#!/usr/bin/env bash
# Install Debian's Chromium and its driver for the `browser` (Playwright) tests.
#
# Idempotent: installs the `chromium` and `chromium-driver` packages only when
# /usr/bin/chromium or /usr/bin/chromedriver is missing. Playwright's own
# browser download does not work in CI; the e2e tests point Playwright at
# /usr/bin/chromium (override with ISAGI_CHROMIUM). Prints the version.
set -euo pipefail

if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "browser.sh: chromium is missing; run as root to install it with apt-get" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >&2
fi

/usr/bin/chromium --version
