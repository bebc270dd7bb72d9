#!/usr/bin/env bash
# Installs Debian's Prometheus server (tests start their own instances; the packaged service is
# kept from running so it never holds port 9090).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then exit 0; fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# policy-rc.d 101 keeps dpkg from starting the packaged service during install.
printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
$SUDO chmod +x /usr/sbin/policy-rc.d
trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus
