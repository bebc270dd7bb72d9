#!/usr/bin/env bash
# Installs Debian's Prometheus server (tests start their own instances; the packaged service is
# kept from running so it never holds port 9090).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then exit 0; fi
"$(dirname "$0")/apt-install.sh" prometheus
command -v prometheus
