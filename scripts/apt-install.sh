#!/usr/bin/env bash
# apt-get install PACKAGE... quietly, with sudo when not root; dpkg is kept from starting packaged
# services (the tests run their own instances, and a packaged one would hold its port).
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# policy-rc.d 101 keeps dpkg from starting the packaged service during install.
printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
$SUDO chmod +x /usr/sbin/policy-rc.d
trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
$SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
