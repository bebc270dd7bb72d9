#!/usr/bin/env bash
# Installs Debian's HAProxy: the router-replica tests and benchmark run their own instances in the
# foreground (haproxy -db, tests/haproxy_process.py); the packaged service is never started.
set -euo pipefail
if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then exit 0; fi
"$(dirname "$0")/apt-install.sh" haproxy
