"""Configuration: one TOML file read by every daemon of a deployment.

Every key has a default, so ``rolloutd up`` runs with no file at all. Unknown top-level
sections are rejected (a typo should not silently fall back to a default).
"""
from __future__ import annotations

import copy
import os
import socket
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from rolloutd.bus.endpoints import EndpointError, Endpoints

DEFAULTS: dict = {
    "node": "",                # defaults to the host name
    "endpoints": {},           # see rolloutd.bus.endpoints.Endpoints.from_config
    "keys_dir": "",            # CURVE keys from `rolloutd keys generate`; empty = no CURVE
    # A holder lists all its jobs in a heartbeat when it holds at most full_listing_max of them, else
    # only the changes, with a full listing at least every full_listing_s (docs/PROTOCOL.md).
    "daemon": {"heartbeat_s": 1.0, "drain_s": 10.0, "poll_s": 0.2, "full_listing_s": 5.0, "full_listing_max": 128},
    "logging": {"format": "auto", "level": "info"},
    "gateway": {
        "max_request_bytes": 16 << 20,
        # Work per request, so no request holds the gateway's loop long (docs/PROTOCOL.md, "Bounds"):
        "max_request_ids": 10000,    # job ids one cancel may name (worked through 256 per loop turn)
        "max_request_jobs": 4096,    # jobs one submit may create (the sum of its tasks' n; made 512 per loop turn)
        "max_request_values": 1 << 19,  # values a request may hold once decoded (a list or map counts 8 + entries)
        "max_poll_results": 256,     # results one poll reply carries at most (a larger max_results is cut)
        "journal": "",              # SQLite path; empty = in memory only
        "journal_sync": "normal",   # "full" also survives power loss, at a cost per commit
        "default_budget_s": 3600.0,
        "lease_timeout_s": 10.0,    # a job unseen in any heartbeat for this long is re-dispatched
        "daemon_dead_s": 5.0,       # a daemon silent this long is presumed dead
        "daemon_hung_s": 30.0,      # ... unless its liveness thread says its loop is busy, for up to this lag
        "max_attempts": 3,
        "retention_s": 86400.0,     # un-acknowledged results of vanished clients are dropped after this
        "router_timeout_s": 5.0,
    },
    "init": {"pool": 32, "prefetch": -1},
    "run": {"pool": 512, "prefetch": -1, "llm_timeout_s": 300.0},
    "eval": {"pool": 32, "prefetch": -1},
    # A new lease goes only to a backend within max_policy_lag of the newest registered version; jobs
    # on older ones: stale_policy = finish | abort_requeue (a counted attempt) | drop | continue
    # (abort the generation in flight, continue it on a current server). docs/TRAINERS.md.
    "router": {"policy": "least_inflight", "health_interval_s": 5.0, "health_failures": 3,
               "lease_ttl_s": 30.0, "node_affinity": 0.1, "max_policy_lag": 0,
               "stale_policy": "finish",
               # Router processes on the head, each owning the backends and serving the nodes that hash
               # to it (docs/SCALING.md "Router shards"); 1 = one router, as before.
               "shards": 1},
    "sandbox": {"runtime": "auto", "root_dir": "", "janitor_interval_s": 5.0, "janitor_grace_s": 10.0,
                "quota_interval_s": 1.0, "disk_low_mb": 1024,
                "disk_quota": "auto",   # auto | loop | tmpfs | measured (docs/SANDBOX.md "Disk quota")
                "shm_size_mb": 64,      # bwrap: /dev/shm is a tmpfs of this size
                "disk_pool": 2,         # loop quota: workspaces made ahead, per recent size (0: off)
                # bwrap as root: each sandbox runs as a host uid of its own from this range (per-uid
                # kernel limits per sandbox); "" = every sandbox as nobody (docs/SANDBOX.md "Round 2")
                "uid_range": "2000000000-2000065535"},
    "handlers": {},                # per-handler config, by name
}


class ConfigError(ValueError):
    pass


class Config:
    def __init__(self, data: dict | None = None, path: str | None = None):
        merged = copy.deepcopy(DEFAULTS)
        for key, val in (data or {}).items():
            if key not in DEFAULTS:
                raise ConfigError(f"unknown config section {key!r} in {path or 'config'}")
            if isinstance(DEFAULTS[key], dict) and key not in ("endpoints", "handlers"):
                if not isinstance(val, dict):
                    raise ConfigError(f"[{key}] must be a table")
                unknown = set(val) - set(DEFAULTS[key])
                if unknown:
                    raise ConfigError(f"unknown keys in [{key}]: {sorted(unknown)}")
                merged[key].update(val)
            else:
                merged[key] = val
        self.data = merged
        self.path = path
        self.node = merged["node"] or socket.gethostname()
        if not isinstance(self.node, str) or "/" in self.node:  # "/" closes the name in heartbeat topics
            raise ConfigError(f"node name {self.node!r} in {path or 'config'}: must be a string without '/' "
                              f"(it ends the node in heartbeat topics, docs/EVENTS.md)")
        shards = merged["router"]["shards"]
        if shards.__class__ is not int or not 1 <= shards <= 64:
            raise ConfigError(f"router.shards = {shards!r} in {path or 'config'}: must be an integer from 1 to 64")
        ep = dict(merged["endpoints"])
        if not ep:
            ep = {"runtime_dir": str(default_runtime_dir())}
        try:
            self.endpoints = Endpoints.from_config(ep)
        except EndpointError as e:
            raise ConfigError(f"{path or 'config'}: {e}") from None
        rt = ep.get("runtime_dir")
        self.runtime_dir = Path(rt) if rt else default_runtime_dir()

    def __getitem__(self, key):
        return self.data[key]

    def section(self, key) -> dict:
        return self.data[key]

    @classmethod
    def load(cls, path: str | os.PathLike | None) -> "Config":
        if path is None:
            env = os.environ.get("ROLLOUTD_CONFIG")
            path = env or None
        if path is None:
            return cls()
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p}: {e}") from None
        return cls(data, str(p))

    def sandbox_root(self) -> Path:
        """Where this deployment's sandboxes live. Never nested with the runtime directory
        (see check_layout). One root per deployment, so two deployments' janitors never reap
        each other's."""
        root = self.data["sandbox"]["root_dir"]
        if root:
            return Path(root)
        import hashlib

        from rolloutd.sandbox.runtime import default_root

        tag = hashlib.sha1(str(self.runtime_dir.resolve()).encode()).hexdigest()[:10]
        return default_root() / f"d-{tag}"

    def check_layout(self) -> None:
        """Refuse a runtime directory and a sandbox root that nest. The runtime directory is
        made private (0700) at every start; the sandbox root must stay traversable by the uid
        sandboxes run as (nobody, when the daemons are root). Nested, the two fight over one
        directory's mode and every sandbox of every deployment under it fails to start."""
        rt = self.runtime_dir.resolve()
        sb = self.sandbox_root().resolve()
        if rt == sb or rt in sb.parents or sb in rt.parents:
            raise ConfigError(
                f"the runtime directory {rt} and the sandbox root {sb} nest; they must be apart: the "
                "runtime directory is private (0700), the sandbox root must be traversable by the "
                "sandbox uid. Set [sandbox] root_dir (or ROLLOUTD_SANDBOX_ROOT) or --runtime-dir "
                "(or ROLLOUTD_RUNTIME_DIR) so that neither contains the other.")

    def curve(self, name: str):
        if not self.data["keys_dir"]:
            return None
        from rolloutd.bus.endpoints import ROUTER, router_shard
        from rolloutd.bus.sockets import Curve

        if router_shard(name) is not None:  # every router shard binds with the router's (the server's) keys
            name = ROUTER
        return Curve.from_dir(self.data["keys_dir"], name)


def default_runtime_dir() -> Path:
    if os.environ.get("ROLLOUTD_RUNTIME_DIR"):
        return Path(os.environ["ROLLOUTD_RUNTIME_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "rolloutd"
    return Path("/tmp") / f"rolloutd-{os.getuid()}"


def dump_toml(data: dict) -> str:
    """A minimal TOML writer for the configs ``rolloutd up`` hands its children."""
    lines: list[str] = []
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    for k, v in top.items():
        lines.append(f"{k} = {_toml_value(v)}")
    for section, table in data.items():
        if not isinstance(table, dict):
            continue
        _dump_table(lines, section, table)
    return "\n".join(lines) + "\n"


def _dump_table(lines, name, table):
    lines.append(f"\n[{name}]")
    nested = []
    for k, v in table.items():
        if isinstance(v, dict):
            nested.append((k, v))
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in nested:
        _dump_table(lines, f"{name}.{k}", v)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {type(v).__name__} to TOML")
