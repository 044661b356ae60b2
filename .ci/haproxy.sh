#!/usr/bin/env bash
# Install Debian's HAProxy for the `replicas` tests (tests/test_replicas_balancer.py and the page's
# in tests/e2e/test_replicas_browser.py start their own from docker/haproxy/haproxy.cfg).
#
# Idempotent: installs the `haproxy` package only when /usr/sbin/haproxy is missing, and never
# starts the package's own service (a policy-rc.d refuses it for the install, as docker/test.sh
# does for docker.io). Prints the version.
set -euo pipefail

if [ ! -x /usr/sbin/haproxy ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "haproxy.sh: haproxy is missing; run as root to install it with apt-get" >&2
        exit 1
    fi
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        policy=/usr/sbin/policy-rc.d
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends haproxy >&2
    [ -n "$policy" ] && rm -f "$policy"
fi

# sed reads to the end: with pipefail, `head` closing the pipe early made haproxy die of SIGPIPE
/usr/sbin/haproxy -v | sed -n 1p
