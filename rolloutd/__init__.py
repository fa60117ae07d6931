"""rolloutd: rollout-as-a-service for multi-turn agent RL.

The repository keeps the design card's folders at its top (``bus/ daemons/ gateway/
handlers/ sandbox/ llm/ endpoint/ backends/ systemd/``); they install and import as subpackages of this one
package (``rolloutd.bus``, ``rolloutd.gateway``, ...). Importing ``rolloutd`` itself is
cheap: the client names below load on first use, and need only pyzmq, msgpack and numpy.
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version as _dist_version

try:
    __version__ = _dist_version("rolloutd")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "RolloutClient": "rolloutd.gateway.client",
    "GatewayError": "rolloutd.gateway.client",
    "GatewayTimeout": "rolloutd.gateway.client",
    "BatchClient": "rolloutd.gateway.batch",
    "PROTOCOL_VERSION": "rolloutd.bus.messages",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'rolloutd' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
