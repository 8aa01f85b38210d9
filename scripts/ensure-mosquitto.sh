#!/usr/bin/env bash
# The fleet tests (tests/test_fleet.py) start their own mosquitto broker on a
# loopback port. Install Debian's package when it is missing. Never fails: where
# apt-get is unavailable (or not allowed), those tests are skipped and say why.
PATH="$PATH:/usr/sbin:/usr/local/sbin"
if command -v mosquitto >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-mosquitto: no mosquitto and no apt-get; the fleet tests will be skipped" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "ensure-mosquitto: not root and no passwordless sudo; the fleet tests will be skipped" >&2
    exit 0
  fi
fi
echo "ensure-mosquitto: installing mosquitto (Debian package) for the fleet tests" >&2
install() { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null 2>&1; }
# The package lists may be fresh already; refresh them only when the first try fails.
if ! (install || ($SUDO apt-get update -qq >/dev/null 2>&1 && install)); then
  echo "ensure-mosquitto: apt-get could not install mosquitto; the fleet tests will be skipped" >&2
fi
exit 0
