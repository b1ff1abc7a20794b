#!/usr/bin/env bash
# System tools the test suite uses beyond Python: docker-compose (its own config checker, for
# docker-compose.yml), iproute2 and util-linux (network namespaces for the multihost tests).
# Installs what is missing when run as root; otherwise says what the skipped tests need.
set -euo pipefail
# Slurm (slurm-wlm + munge) for tests/slurm: its own script, also usable alone.
bash "$(dirname "$0")/install-slurm.sh"
need=()
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing test tools: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
else
  echo "note: missing ${need[*]}; the tests that need them skip (install them, or run as root)" >&2
fi
