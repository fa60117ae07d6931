"""The daemon main loop every process shares.

Signal handlers only flip state and wake the loop; the loop polls with timeouts, publishes
a heartbeat, drains on SIGTERM within a deadline, and on a fatal error publishes a death
notice before exiting non-zero.
"""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
import traceback

from rolloutd.bus.events import Publisher
from rolloutd.bus.sockets import Sockets
from rolloutd.bus import logs
from rolloutd.bus.config import Config


class Daemon:
    name = "daemon"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.node = cfg.node
        self.dcfg = cfg.section("daemon")
        self.log = logs.get(f"rolloutd.{self.name}").bind(daemon=self.name, node=self.node)
        self.stopping = False
        self.started_at = time.time()
        self.incarnation = f"{os.getpid()}-{int(self.started_at * 1000)}"
        self.sockets: Sockets | None = None
        self.events: Publisher | None = None
        self._stop_event: asyncio.Event | None = None
        self._loop_beat = time.monotonic()  # when the loop last published a heartbeat

    # -- to override ------------------------------------------------------------------
    async def setup(self) -> None:
        """Create sockets and state."""

    async def serve(self) -> None:
        """The work loop; return when ``self.stopping`` is set and the work is drained."""
        await self.wait_stop()

    async def teardown(self) -> None:
        """Free what setup made, beyond sockets (closed by the base)."""

    def heartbeat(self) -> dict:
        """Fields of this daemon's heartbeat."""
        return {}

    # -- machinery ----------------------------------------------------------------------
    def main(self) -> int:
        lc = self.cfg.section("logging")
        logs.configure(lc["format"], lc["level"], daemon=self.name, node=self.node)
        # Re-bind: the logger bound in __init__ captured structlog's default configuration
        # (console renderer on stdout), not the one just configured.
        self.log = logs.get(f"rolloutd.{self.name}").bind(daemon=self.name, node=self.node)
        return asyncio.run(self._main())

    def request_stop(self, signame: str = "request"):
        if not self.stopping:
            self.log.info("stop_requested", signal=signame)
        self.stopping = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def wait_stop(self, timeout_s: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._stop_event.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        self.sockets = Sockets(self.cfg.endpoints, curve=self.cfg.curve(self.name))
        self.events = Publisher(self.sockets, self.name, self.node)
        rc = 0
        hb = None
        alive_stop = threading.Event()
        alive = None
        try:
            await self.setup()
            # Everything imported so far lives as long as the daemon: keep the collector off it
            # (a full pass over transformers' objects costs ~125 ms of a run daemon's loop).
            gc.freeze()
            self.log.info("daemon_started", pid=os.getpid(), incarnation=self.incarnation)
            self.events.publish("daemon.started", incarnation=self.incarnation)
            hb = asyncio.create_task(self._heartbeats())
            alive = threading.Thread(target=self._liveness, args=(alive_stop,), name="liveness", daemon=True)
            alive.start()
            await self.serve()
        except Exception as e:  # noqa: BLE001 - the death notice must go out whatever broke
            rc = 1
            self.log.error("daemon_crashed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            self.events.publish("daemon.died", incarnation=self.incarnation, error=f"{type(e).__name__}: {e}")
        finally:
            if hb is not None:
                hb.cancel()
            alive_stop.set()
            if alive is not None:
                alive.join(5.0)
            try:
                await self.teardown()
            except Exception as e:  # noqa: BLE001
                rc = rc or 1
                self.log.error("teardown_failed", error=f"{type(e).__name__}: {e}")
            if rc == 0:
                self.events.publish("daemon.stopped", incarnation=self.incarnation)
            self.log.info("daemon_stopped", rc=rc)
            self.sockets.close()
        return rc

    def _liveness(self, stop: threading.Event):
        """A thread apart from the loop: while the loop's heartbeat is late (the loop is busy: a
        long callback, a GIL-holding call), it publishes ``daemon.busy`` with the loop's lag, so
        the gateway can tell a busy daemon from a dead one (docs/RELIABILITY.md). A stopped or
        hung process sends nothing at all.

        It owns a sync context and PUB socket, made and closed in this thread: the daemon's
        sockets are asyncio ones, bound to the loop's thread (used from here they raised "There
        is no current event loop in thread 'liveness'" and the thread died unseen, issue 38)."""
        period = float(self.dcfg["heartbeat_s"])
        try:
            sockets = Sockets(self.cfg.endpoints, asyncio=False, curve=self.cfg.curve(self.name), linger_ms=0)
        except Exception as e:  # noqa: BLE001 - a daemon without a liveness thread still runs
            self.log.error("liveness_failed", error=f"{type(e).__name__}: {e}")
            return
        try:
            pub = Publisher(sockets, self.name, self.node)
            while not stop.wait(period):
                lag = time.monotonic() - self._loop_beat
                if lag > 2 * period:
                    pub.publish("daemon.busy", incarnation=self.incarnation, loop_lag_s=round(lag, 3))
        except Exception as e:  # noqa: BLE001 - said once in the log, never a silent death
            self.log.error("liveness_failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        finally:
            sockets.close()

    # Head daemons hold tables of hundreds of thousands of records (the gateway's jobs, the router's
    # leases): a full collection walks them all, 180-270 ms of a stalled loop at 648,000 jobs
    # (poll p99 ~100 ms at 1,000 nodes, docs/SCALING.md section 8). After each full collection its
    # survivors are frozen, so the next walks only what came since. The records hold no reference
    # cycles; a frozen object that later becomes cyclic garbage is kept (that is the price).
    freeze_after_full_gc = False

    def _freeze_survivors(self):
        full = gc.get_stats()[2]["collections"]
        if full != self._full_gcs:
            self._full_gcs = full
            gc.freeze()

    async def _heartbeats(self):
        period = float(self.dcfg["heartbeat_s"])
        self._full_gcs = gc.get_stats()[2]["collections"]
        while True:
            self._loop_beat = time.monotonic()
            if self.freeze_after_full_gc:
                self._freeze_survivors()
            try:
                self.events.publish("daemon.heartbeat", incarnation=self.incarnation,
                                    uptime_s=round(time.time() - self.started_at, 3), **self.heartbeat())
            except Exception as e:  # noqa: BLE001 - a heartbeat must never kill the daemon
                self.log.warning("heartbeat_failed", error=str(e))
            await asyncio.sleep(period)
