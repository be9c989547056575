#!/usr/bin/env bash
# What the tests need beyond Python packages, from Debian's packages, installed with apt only when
# missing (a no-op otherwise): chromium, which tests/test_dashboard.py drives through playwright
# (playwright downloads no browser of its own here), and iproute2 and nftables, with which
# benchmarks/net.py builds the emulated internet of tests/test_net.py (network namespaces need root:
# as another user those tests skip and say why).
set -euo pipefail
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
command -v nft >/dev/null || missing+=(nftables)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "tests: missing ${missing[*]} and there is no apt-get to install them; install Debian's ${missing[*]}" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  sudo="sudo"
fi
echo "tests: installing Debian's ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq "${missing[@]}" >/dev/null
if [ ! -x /usr/bin/chromium ]; then
  echo "tests: apt-get installed chromium, but /usr/bin/chromium is still missing" >&2
  exit 1
fi
