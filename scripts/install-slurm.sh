#!/usr/bin/env bash
# Slurm for tests/slurm: Debian's slurm-wlm (slurmctld, slurmd and the client commands) and
# munge, its authentication daemon. Installs what is missing when run as root with apt-get;
# otherwise says so and exits 0 (tests/slurm then skips, naming this script). Idempotent and
# quiet: nothing is printed when everything is already there. Starts no daemon: the tests'
# fixture starts its own slurmctld, slurmd and munged, with a config of its own.
set -euo pipefail
need=()
for cmd in slurmctld slurmd srun sbatch sinfo squeue scontrol scancel; do
  command -v "$cmd" >/dev/null 2>&1 || { need+=(slurm-wlm); break; }
done
command -v munged >/dev/null 2>&1 || need+=(munge)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "note: missing ${need[*]}; tests/slurm skips (run scripts/install-slurm.sh as root, with apt-get)" >&2
  exit 0
fi
echo "installing slurm: ${need[*]}"
# No daemon starts at install time (no init system here, and the tests run their own): a
# policy-rc.d that refuses every start, only for this install and only if none is there yet.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  own_policy=1
fi
trap '[ "$own_policy" = 1 ] && rm -f "$policy"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
  apt-get update -qq
  if ! apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
    echo "note: could not install ${need[*]}; tests/slurm skips" >&2
    exit 0
  fi
fi
