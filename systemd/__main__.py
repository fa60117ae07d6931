"""``python -m rolloutd.systemd COMMAND``: install the rolloutd units, check them, find the Slurm scripts.

    python -m rolloutd.systemd install [--dest /etc/systemd/system] [--bin PATH] [--instance main] [--head HOST]
                                       [--router-shards K]
    python -m rolloutd.systemd render OUTDIR [--bin PATH] [--router-shards K]
    python -m rolloutd.systemd verify [--bin PATH] [--instance main] [--router-shards K]

``--router-shards K`` (the deployment's ``router.shards``): a unit for each router shard 1..K-1
(``rolloutd-router1@.service``, ...) and the head target starting them.
    python -m rolloutd.systemd example-config [--instance main] [--head HOST]
    python -m rolloutd.systemd slurm-path | sbatch-path
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rolloutd import systemd as units


def _router_shards(sp):
    sp.add_argument("--router-shards", type=int, default=1, metavar="K",
                    help="router.shards of the deployment: a unit per shard 1..K-1 (default 1: none)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rolloutd.systemd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("install", help="write the units (and an example config if none) and reload systemd")
    sp.add_argument("--dest", default="/etc/systemd/system")
    sp.add_argument("--bin", help="rolloutd executable for ExecStart (default: beside this python, else PATH)")
    sp.add_argument("--instance", default="main", help="deployment whose example config to write")
    sp.add_argument("--head", default="head.example", help="head host for the example config")
    sp.add_argument("--config-dir", default="/etc/rolloutd")
    sp.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    _router_shards(sp)
    sp = sub.add_parser("render", help="write the units with ExecStart rewritten into OUTDIR")
    sp.add_argument("outdir")
    sp.add_argument("--bin")
    _router_shards(sp)
    sp = sub.add_parser("verify", help="systemd-analyze verify every unit (rendered for --bin)")
    sp.add_argument("--bin")
    sp.add_argument("--instance", default="main")
    _router_shards(sp)
    sp = sub.add_parser("example-config", help="print an example /etc/rolloutd/INSTANCE.toml")
    sp.add_argument("--instance", default="main")
    sp.add_argument("--head", default="head.example")
    sub.add_parser("slurm-path", help="print the path of the Slurm launcher (rolloutd-slurm.sh)")
    sub.add_parser("sbatch-path", help="print the path of the sbatch script (rolloutd.sbatch)")
    a = p.parse_args(argv)

    if a.cmd == "slurm-path":
        print(units.slurm_launcher())
        return 0
    if a.cmd == "sbatch-path":
        print(units.slurm_batch())
        return 0
    if a.cmd == "example-config":
        print(units.EXAMPLE_CONFIG.format(instance=a.instance, head=a.head), end="")
        return 0
    if a.cmd == "render":
        for path in units.write_units(a.outdir, a.bin or units.find_rolloutd(), a.router_shards):
            print(path)
        return 0
    if a.cmd == "verify":
        with tempfile.TemporaryDirectory() as d:
            units.write_units(d, a.bin or units.find_rolloutd(), a.router_shards)
            rc, out = units.verify(d, a.instance, a.router_shards)
        if out:
            print(out, file=sys.stderr)
        return 1 if rc or out else 0
    # install
    import subprocess

    for path in units.write_units(a.dest, a.bin or units.find_rolloutd(), a.router_shards):
        print(f"wrote {path}")
    cfg = Path(a.config_dir) / f"{a.instance}.toml"
    if not cfg.exists():
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(units.EXAMPLE_CONFIG.format(instance=a.instance, head=a.head))
        print(f"wrote {cfg} (an example: edit endpoints.head and keys_dir)")
    if not a.no_reload:
        subprocess.run(["systemctl", "daemon-reload"], check=False)
    print("next: useradd --system --home-dir /var/lib/rolloutd --shell /usr/sbin/nologin rolloutd; "
          f"systemctl enable --now rolloutd-head@{a.instance}.target (head) / "
          f"rolloutd-worker@{a.instance}.target (workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
