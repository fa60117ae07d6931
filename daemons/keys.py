"""``rolloutd keys``: CURVE keys for tcp deployments.

    rolloutd keys generate DIR [--names client,monitor,...] [--force]
    rolloutd keys bundle DIR OUT --role head|worker|client [--names ...]
    rolloutd keys show DIR

``generate`` makes, with ``rolloutd.bus.sockets.generate_keys``, the ``server`` key pair and one pair
per name, and copies every public key into ``DIR/authorized/`` (the set of keys the head's
sockets accept). A daemon loads ``DIR/<its name>.key_secret`` and ``DIR/server.key``.

The head daemons (gateway, router, events) bind the tcp sockets, so their key pair *is* the
server pair: their files are copies of ``server.key``/``server.key_secret``. Treat those as
the server secret: they belong on the head node only. Worker nodes get ``server.key`` (public)
and their own ``init``/``run``/``eval`` secrets; a trainer gets ``server.key`` and
``client.key_secret``. ``bundle`` copies exactly that subset for one role.

Revoking a key: delete its ``authorized/<name>.key`` on the head and restart the head daemons.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HEAD_NAMES = ("gateway", "router", "events")
WORKER_NAMES = ("init", "run", "eval")
TOOL_NAMES = ("client", "monitor", "exporter")
DEFAULT_NAMES = HEAD_NAMES + WORKER_NAMES + TOOL_NAMES
ROLES = {
    "head": HEAD_NAMES + TOOL_NAMES,   # the head also runs status/monitor/exporter locally
    "worker": WORKER_NAMES,
    "client": ("client", "monitor", "exporter"),
}


class KeysError(RuntimeError):
    pass


def _names(raw: str | None) -> list[str]:
    if raw is None:
        return list(DEFAULT_NAMES)
    names = [n.strip() for n in raw.split(",") if n.strip()]
    bad = [n for n in names if n == "server" or not n.replace("-", "").replace("_", "").isalnum()]
    if bad:
        raise KeysError(f"invalid key names: {bad} (letters, digits, - and _; 'server' is reserved)")
    return list(dict.fromkeys(names))


def generate(keys_dir: str | Path, names: list[str] | None = None, force: bool = False) -> list[Path]:
    """Create the server pair and a pair per name; head names share the server pair."""
    from rolloutd.bus.sockets import generate_keys

    d = Path(keys_dir)
    names = list(DEFAULT_NAMES) if names is None else list(names)
    if (d / "server.key_secret").exists() and not force:
        raise KeysError(f"{d} already holds a server key; pass --force to replace every key "
                        "(clients holding the old server.key will no longer connect)")
    if force and (d / "authorized").is_dir():
        shutil.rmtree(d / "authorized")
    own = [n for n in names if n not in HEAD_NAMES]
    made = generate_keys(d, own)
    for n in names:
        if n in HEAD_NAMES:
            for suffix in (".key", ".key_secret"):
                dst = d / f"{n}{suffix}"
                shutil.copyfile(d / f"server{suffix}", dst)
                dst.chmod(0o600 if suffix == ".key_secret" else 0o644)
                made.append(dst)
    return made


def bundle(keys_dir: str | Path, out: str | Path, role: str, names: list[str] | None = None) -> list[Path]:
    """Copy what one node of ``role`` needs into ``out``."""
    src, dst = Path(keys_dir), Path(out)
    if role not in ROLES:
        raise KeysError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    if not (src / "server.key").exists():
        raise KeysError(f"{src} has no server.key; run `rolloutd keys generate {src}` first")
    dst.mkdir(parents=True, exist_ok=True, mode=0o700)
    dst.chmod(0o700)
    wanted = list(names) if names else list(ROLES[role])
    files = ["server.key"] + [f"{n}.key_secret" for n in wanted] + [f"{n}.key" for n in wanted]
    if role == "head":
        files.append("server.key_secret")
    copied = []
    for f in dict.fromkeys(files):
        if not (src / f).exists():
            raise KeysError(f"{src / f} does not exist (generate it with --names)")
        shutil.copy2(src / f, dst / f)
        copied.append(dst / f)
    if role == "head":
        if (dst / "authorized").exists():
            shutil.rmtree(dst / "authorized")
        shutil.copytree(src / "authorized", dst / "authorized")
        copied.append(dst / "authorized")
    return copied


def show(keys_dir: str | Path) -> dict:
    import zmq.auth

    d = Path(keys_dir)
    out = {"server": None, "keys": {}, "authorized": []}
    if (d / "server.key").exists():
        out["server"] = zmq.auth.load_certificate(d / "server.key")[0].decode()
    for p in sorted(d.glob("*.key")):
        pub, _ = zmq.auth.load_certificate(p)
        out["keys"][p.stem] = {"public": pub.decode(), "secret": (d / f"{p.stem}.key_secret").exists()}
    if (d / "authorized").is_dir():
        out["authorized"] = sorted(p.stem for p in (d / "authorized").glob("*.key"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rolloutd keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("generate", help="create the server key pair and one pair per name")
    sp.add_argument("dir")
    sp.add_argument("--names", help=f"comma-separated key names (default: {','.join(DEFAULT_NAMES)})")
    sp.add_argument("--force", action="store_true", help="replace existing keys")
    sp = sub.add_parser("bundle", help="copy the keys one node needs (head, worker or client) into OUT")
    sp.add_argument("dir")
    sp.add_argument("out")
    sp.add_argument("--role", required=True, choices=sorted(ROLES))
    sp.add_argument("--names", help="key names to include instead of the role's defaults")
    sp = sub.add_parser("show", help="list the keys of DIR and which public keys are authorized")
    sp.add_argument("dir")
    a = p.parse_args(argv)
    try:
        if a.cmd == "generate":
            made = generate(a.dir, _names(a.names), force=a.force)
            for path in made:
                print(path)
            print(f"head node: {a.dir} (all of it); workers: `rolloutd keys bundle {a.dir} OUT --role worker`",
                  file=sys.stderr)
        elif a.cmd == "bundle":
            for path in bundle(a.dir, a.out, a.role, _names(a.names) if a.names else None):
                print(path)
        else:
            import json

            print(json.dumps(show(a.dir), indent=2))
    except KeysError as e:
        print(f"rolloutd keys: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
