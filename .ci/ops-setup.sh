#!/usr/bin/env bash
# Prepare a clean Debian 12 machine (as root) for tests/ops: systemd-analyze for the unit lint,
# Slurm (slurmctld, slurmd, client tools; munge as the fallback auth), iproute2 for network
# namespaces, tmux for the monitor's terminal test. The tests write their own Slurm config in
# a temp dir and start slurmctld/slurmd in the foreground, so nothing under /etc is configured
# and no system service is started here. Idempotent: does nothing when all is in place.
set -euo pipefail

PKGS=(systemd slurmctld slurmd slurm-client munge iproute2 iputils-ping tmux util-linux procps)

if [[ $(id -u) != 0 ]]; then
    echo "ops-setup: must run as root" >&2
    exit 1
fi

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
    echo "ops-setup: installing ${missing[*]}"
    # Keep package scripts from starting slurmctld/slurmd/munge as system services: the tests run
    # their own instances in the foreground (and a stock slurmctld would hold the default ports).
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 755 "$policy"
        made_policy=1
    fi
    trap '[[ $made_policy == 1 ]] && rm -f "$policy"' EXIT
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${missing[@]}" >/tmp/ops-setup-apt.log 2>&1; then
        apt-get update >/dev/null
        apt-get install -y --no-install-recommends "${missing[@]}" >/tmp/ops-setup-apt.log 2>&1 ||
            { tail -n 30 /tmp/ops-setup-apt.log >&2; exit 1; }
    fi
    # Where systemd is running, keep the stock services off (they have no config anyway).
    if [[ -d /run/systemd/system ]]; then
        systemctl disable --now slurmctld.service slurmd.service >/dev/null 2>&1 || true
    fi
fi

# veth and bridge links for the namespace tests (autoloaded on most kernels; best effort).
if command -v modprobe >/dev/null; then modprobe -q veth 2>/dev/null || true; modprobe -q bridge 2>/dev/null || true; fi

# Report what the ops tests will find (they skip with a reason when something is unavailable).
echo "ops-setup: systemd-analyze $(command -v systemd-analyze || echo MISSING)"
echo "ops-setup: slurm $(slurmctld -V 2>/dev/null || echo MISSING)"
if ls /usr/lib/*/slurm-wlm/auth_none.so >/dev/null 2>&1; then
    echo "ops-setup: slurm auth/none available"
else
    echo "ops-setup: slurm auth/none missing; the tests will use munge"
fi
probe=rtdsetup$$
if ip netns add "$probe" 2>/dev/null; then
    if ip -n "$probe" link add rtdp0 type veth peer name rtdp1 2>/dev/null &&
       ip -n "$probe" link add rtdbr0 type bridge 2>/dev/null; then
        echo "ops-setup: network namespaces, veth and bridge available"
    else
        echo "ops-setup: network namespaces available but veth/bridge are not (multi-node test will skip)"
    fi
    ip netns del "$probe"
else
    echo "ops-setup: network namespaces not permitted here (multi-node test will skip)"
fi
