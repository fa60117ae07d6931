"""Endpoints: one object naming every socket after the process that receives on it.

One machine: ``ipc://`` files in a runtime directory. Several nodes: ``tcp://`` for the
sockets that cross nodes (gateway, gateway_results, init, router, events) and ``ipc://``
for the node-local hand-offs (run, eval), whose runtime directory is per node. With
``router.shards`` > 1 the router endpoint names shard 0; the others follow from it (below).
"""
from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

# Who binds each endpoint. Job hand-offs are credit-based (rolloutd.bus.credit): the sender binds a
# ROUTER and each receiver connects a DEALER and announces its free slots, so the names
# still say who receives there, but the sender binds.
BINDER = {
    "gateway": "gateway",          # ROUTER; trainers' REQ/DEALER connect
    "gateway_results": "gateway",  # PULL; init/run/eval PUSH final results
    "init": "gateway",             # ROUTER bound by the gateway; init daemons of every node connect
    "run": "init",                 # ROUTER bound by init; the node's run daemon connects (node-local)
    "eval": "run",                 # ROUTER bound by run; the node's eval daemon connects (node-local)
    "router": "router",            # ROUTER; run daemons and the gateway connect DEALER
    "events_in": "events",         # XSUB; every daemon's PUB connects
    "events_out": "events",        # XPUB; monitors and the gateway SUB connect
}


class EndpointError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Endpoints:
    gateway: str
    gateway_results: str
    init: str
    run: str
    eval: str
    router: str
    events_in: str
    events_out: str

    @classmethod
    def local(cls, runtime_dir: str | os.PathLike) -> "Endpoints":
        """All sockets as ipc files in one runtime directory (one machine)."""
        d = Path(runtime_dir)
        return cls(**{name: f"ipc://{d / (name + '.sock')}" for name in BINDER})

    @classmethod
    def from_config(cls, cfg: dict) -> "Endpoints":
        """Build from the ``[endpoints]`` table of a config file.

        ``runtime_dir`` fills every name not given explicitly with an ipc path;
        ``head = "host"`` plus ``base_port`` fills the cross-node names with tcp.
        """
        cfg = dict(cfg)
        runtime_dir = cfg.pop("runtime_dir", None)
        head = cfg.pop("head", None)
        base_port = int(cfg.pop("base_port", 5550))
        unknown = set(cfg) - set(BINDER)
        if unknown:
            raise EndpointError(f"unknown endpoint names: {sorted(unknown)}")
        values: dict[str, str] = {}
        if runtime_dir:
            values.update(dataclasses.asdict(cls.local(runtime_dir)))
        if head:
            for i, name in enumerate(["gateway", "gateway_results", "init", "router", "events_in", "events_out"]):
                values[name] = f"tcp://{head}:{base_port + i}"
        values.update(cfg)
        missing = set(BINDER) - set(values)
        if missing:
            raise EndpointError(f"endpoints missing (give runtime_dir, head or each name): {sorted(missing)}")
        for name, addr in values.items():
            if not addr.startswith(("ipc://", "tcp://", "inproc://")):
                raise EndpointError(f"endpoint {name}={addr!r}: expected ipc://, tcp:// or inproc://")
        return cls(**values)

    def to_config(self) -> dict:
        return dataclasses.asdict(self)

    def bind_address(self, name: str) -> str:
        """The address to bind: a tcp host name becomes ``*`` so every interface listens."""
        addr = getattr(self, name)
        if addr.startswith("tcp://"):
            _, port = addr[6:].rsplit(":", 1)
            return f"tcp://*:{port}"
        return addr

    def ipc_paths(self) -> list[Path]:
        return [Path(a[6:]) for a in dataclasses.asdict(self).values() if a.startswith("ipc://")]

    def is_tcp(self, name: str) -> bool:
        return getattr(self, name).startswith("tcp://")


# -- router shards (``router.shards``, docs/SCALING.md "Router shards") ---------------------------
# With K > 1 router processes, each owns a group of backends and serves a group of nodes: both
# by a stable hash (crc32, the same in every process and release; Python's hash() is salted per
# process). Shard 0 is the router of a one-router deployment: same name, same address.
ROUTER = "router"


def shard_of(key: str, shards: int) -> int:
    """The shard that owns a backend address or serves a node's run daemon."""
    if shards <= 1:
        return 0
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % shards


def router_name(shard: int) -> str:
    """The daemon name of router shard ``shard`` (its heartbeat topic, logs, status): "router",
    "router1", "router2", ..."""
    return ROUTER if shard == 0 else f"{ROUTER}{shard}"


def router_shard(name: str) -> int | None:
    """The shard a daemon name belongs to, or None when it is no router's."""
    if name == ROUTER:
        return 0
    rest = name[len(ROUTER):] if name.startswith(ROUTER) else ""
    return int(rest) if rest.isdigit() and rest[0] != "0" else None


def _shift(addr: str, shard: int) -> str:
    """Shard ``shard``'s address from shard 0's: ``router1.sock`` next to ``router.sock`` (ipc), the
    router port + 2 + shard (tcp: with ``head``/``base_port``, the ports after ``events_out``)."""
    if shard == 0:
        return addr
    if addr.startswith("tcp://"):
        host, port = addr[6:].rsplit(":", 1)
        return f"tcp://{host}:{int(port) + 2 + shard}"
    if addr.startswith("ipc://") and addr.endswith(".sock"):
        return f"{addr[:-5]}{shard}.sock"
    return f"{addr}{shard}"


def router_address(endpoints: Endpoints, shard: int) -> str:
    """Where router shard ``shard`` listens (what a run daemon or the gateway connects)."""
    return _shift(endpoints.router, shard)


def router_bind_address(endpoints: Endpoints, shard: int) -> str:
    """What router shard ``shard`` binds."""
    return _shift(endpoints.bind_address("router"), shard)


def router_ipc_paths(endpoints: Endpoints, shards: int) -> list[Path]:
    """The ipc files of shards 1..K-1 (shard 0's is in ``Endpoints.ipc_paths``)."""
    return [Path(a[6:]) for a in (router_address(endpoints, i) for i in range(1, shards)) if a.startswith("ipc://")]
