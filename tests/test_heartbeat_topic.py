"""Per-sender heartbeat topics (issue 40): a heartbeat's topic frame names its daemon and node, so an
init daemon receives its own node's run and eval heartbeats only and a run daemon the router's only,
while ``daemon.`` / ``daemon.heartbeat`` subscribers (gateway, monitor, exporter) still get them all
and still read the topic ``daemon.heartbeat`` (docs/EVENTS.md, "Heartbeat topics")."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from rolloutd.bus import events
from rolloutd.bus.config import Config, ConfigError
from rolloutd.bus.endpoints import Endpoints
from rolloutd.bus.sockets import Sockets
from rolloutd.daemons.phase import InitDaemon, RunDaemon
from tests.conftest import REPO, short_tmpdir, wait_for, remove_tree

# n7 and n70: a subscription for n7 must not select n70 (topic prefixes)
SENDERS = [(d, n) for n in ("n7", "n70") for d in ("init", "run", "eval")] + [("router", "head"), ("gateway", "head")]


@pytest.fixture
def events_daemon():
    """A real events daemon (the XSUB/XPUB proxy) in a private runtime directory."""
    rd = short_tmpdir("hbt-")
    run = rd / "run"
    log = open(rd / "events.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", "events", "--runtime-dir", str(run)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_for(lambda: (run / "events_out.sock").exists() and (run / "events_in.sock").exists(), 60,
                 "the events daemon's sockets")
        yield Endpoints.local(run)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            log.close()
            remove_tree(rd)


def _senders_seen(got: list) -> set:
    return {(b["daemon"], b["node"]) for _, b in got}


def test_each_daemon_gets_the_heartbeats_it_subscribes_to_and_readers_see_the_base_topic(events_daemon):
    subs = Sockets(events_daemon, asyncio=False, linger_ms=0)
    pubs = Sockets(events_daemon, asyncio=False, linger_ms=0)
    try:
        wanted = {  # subscriber -> (its subscriptions, the senders whose heartbeats it must get)
            "init@n7": (InitDaemon.heartbeat_topics("n7"), {("run", "n7"), ("eval", "n7")}),
            "init@n70": (InitDaemon.heartbeat_topics("n70"), {("run", "n70"), ("eval", "n70")}),
            "run@n7": (RunDaemon.heartbeat_topics("n7"), {("router", "head")}),
            "gateway": ([b"daemon."], set(SENDERS)),
        }
        socks = {name: subs.connect("SUB", "events_out", subscribe=topics) for name, (topics, _) in wanted.items()}
        monitor = events.Subscriber(events_daemon.events_out, ["daemon.heartbeat"])  # monitor's / tests' class
        raw = {name: [] for name in wanted}  # frames as received
        got = {name: [] for name in wanted}  # events.parse of them
        via_subscriber = []
        publishers = [events.Publisher(pubs, d, n) for d, n in SENDERS]

        def round_done():
            for p in publishers:
                p.publish("daemon.heartbeat", incarnation="i1", uptime_s=1.0)
            time.sleep(0.05)
            for name, s in socks.items():
                while s.poll(0):
                    frames = s.recv_multipart()
                    raw[name].append(frames)
                    got[name].append(events.parse(frames))
            while (ev := monitor.next(0)) is not None:
                via_subscriber.append(ev)
            return (all(_senders_seen(got[n]) >= want for n, (_, want) in wanted.items())
                    and _senders_seen(via_subscriber) == set(SENDERS))

        wait_for(round_done, 60, "every subscriber's heartbeats", interval_s=0)
        for name, (_, want) in wanted.items():
            assert _senders_seen(got[name]) == want, f"{name} received heartbeats it did not subscribe to"
            assert {t for t, _ in got[name]} == {"daemon.heartbeat"}
        # The topic frame itself: base topic, "/", daemon@node, "/" (the closing "/" keeps n7 from n70)
        frames = {(events.parse(f)[1]["daemon"], events.parse(f)[1]["node"]): f[0] for f in raw["gateway"]}
        assert frames[("run", "n7")] == b"daemon.heartbeat/run@n7/"
        assert frames[("router", "head")] == b"daemon.heartbeat/router@head/"
        assert {t for t, _ in via_subscriber} == {"daemon.heartbeat"}
        monitor.close()
    finally:
        subs.close()
        pubs.close()


def test_a_heartbeat_without_a_sender_suffix_still_parses():
    """Publishers from before the per-sender topic (and the benches' raw frames) still read right."""
    import rolloutd.bus.codec as codec

    body = codec.pack({"daemon": "run", "node": "n1"})
    assert events.parse([b"daemon.heartbeat", body])[0] == "daemon.heartbeat"
    assert events.parse([b"daemon.heartbeat/run@n1/", body])[0] == "daemon.heartbeat"
    assert events.parse([b"job.done", body])[0] == "job.done"


def test_a_node_or_daemon_name_that_would_break_topic_matching_is_refused():
    with pytest.raises(ValueError, match="node name 'a/b'"):
        events.heartbeat_topic("run", "a/b")
    with pytest.raises(ValueError, match="daemon name 'r@x'"):
        events.heartbeat_topic("r@x", "n1")
    with pytest.raises(ConfigError, match="node name 'a/b'"):
        Config({"node": "a/b"})
    assert events.heartbeat_topic("run") == "daemon.heartbeat/run@"  # every run daemon, any node


def test_a_real_deployment_subscribes_to_no_heartbeat_beyond_what_each_daemon_needs(up_factory):
    """The topics the whole stack subscribes to, read where the events daemon sends them: upstream,
    to every publisher (an XPUB connected to events_in receives them all). Only the gateway's
    ``daemon.`` selects the heartbeats of another node's run daemon or of this node's init."""
    up = up_factory("node=n7")
    ctx = zmq.Context()
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    xpub.connect(f"ipc://{up.runtime_dir}/events_in.sock")
    topics: set[bytes] = set()

    def selecting(daemon: str, node: str) -> set:
        frame = f"daemon.heartbeat/{daemon}@{node}/".encode()
        return {t for t in topics if frame.startswith(t)}

    def collect():
        while xpub.poll(100):
            msg = xpub.recv()
            if msg[:1] == b"\x01":
                topics.add(msg[1:])
            elif msg[:1] == b"\x00":
                topics.discard(msg[1:])
        # run's backend.added goes out before its heartbeat subscription, on the same socket
        return b"backend.added" in topics and selecting("run", "n7") - {b"daemon."} and selecting(
            "router", "head") - {b"daemon."}

    try:
        wait_for(collect, 60, "the deployment's subscriptions", interval_s=0)
        assert selecting("run", "n70") == {b"daemon."}, sorted(topics)
        assert selecting("init", "n7") == {b"daemon."}, sorted(topics)
        assert selecting("gateway", "head") == {b"daemon."}, sorted(topics)
        assert selecting("run", "n7") == {b"daemon.", b"daemon.heartbeat/run@n7/"}, sorted(topics)
        assert selecting("eval", "n7") == {b"daemon.", b"daemon.heartbeat/eval@n7/"}, sorted(topics)
        assert selecting("router", "any") == {b"daemon.", b"daemon.heartbeat/router@"}, sorted(topics)
    finally:
        xpub.close()
        ctx.term()
