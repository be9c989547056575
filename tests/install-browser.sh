#!/usr/bin/env bash
# Debian's chromium, which tests/test_dashboard.py drives through playwright (playwright downloads
# no browser of its own here). Installed with apt when /usr/bin/chromium is missing; a no-op otherwise.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "tests: /usr/bin/chromium is missing and there is no apt-get to install it; install Debian's chromium" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  sudo="sudo"
fi
echo "tests: installing Debian's chromium for the dashboard tests (apt-get)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq chromium >/dev/null
if [ ! -x /usr/bin/chromium ]; then
  echo "tests: apt-get installed chromium, but /usr/bin/chromium is still missing" >&2
  exit 1
fi
