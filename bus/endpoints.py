"""Endpoints: one object naming every socket after the process that receives on it.

One machine: ``ipc://`` files in a runtime directory. Several nodes: ``tcp://`` for the
sockets that cross nodes (gateway, gateway_results, init, router, events) and ``ipc://``
for the node-local hand-offs (run, eval), whose runtime directory is per node.
"""
from __future__ import annotations

import dataclasses
import os
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
