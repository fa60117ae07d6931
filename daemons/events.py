"""The events daemon: the XSUB/XPUB proxy every daemon publishes through."""
from __future__ import annotations

from rolloutd.bus.events import Proxy
from rolloutd.bus.sockets import Sockets
from rolloutd.bus.daemon import Daemon


class EventsDaemon(Daemon):
    name = "events"

    async def setup(self):
        self.proxy_sockets = Sockets(self.cfg.endpoints, asyncio=False, curve=self.cfg.curve("events"), linger_ms=0)
        self.proxy = Proxy(self.proxy_sockets)
        self.proxy.start()

    async def serve(self):
        while not self.stopping:
            await self.wait_stop(1.0)
            if not self.proxy.thread.is_alive():
                raise RuntimeError("the events proxy thread stopped")

    async def teardown(self):
        # Let our own death/stop notice pass through before the proxy goes.
        self.proxy.stop()
        self.proxy_sockets.close()
