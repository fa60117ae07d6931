"""Raw ZeroMQ + msgpack baselines, measured on the same machine in the same run as rolloutd:

* ``ping-pong``: a DEALER client and a ROUTER echo server in another process; each side
  unpacks and repacks the msgpack body (the least a Python hop can do). Round-trip times.
* ``chain``: the pipeline's own topology with nothing but transport in it: one "gateway"
  process PUSHes to three forwarder processes in a row (PULL -> msgpack unpack/pack -> PUSH)
  and PULLs what the last one sends back. Messages per second with a bounded window in
  flight. It is the ceiling a four-process Python pipeline reaches on this machine.

Run as a script, this file is the helper process: ``rawzmq.py echo ADDR`` or
``rawzmq.py forward IN OUT``; both stop when their stdin closes or after 120 s.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import msgpack
import zmq

# A body like a zero-latency job header on the wire (about the size codec.encode makes).
PAYLOAD = {
    "v": 1, "kind": "job", "job_id": 1_700_000_000_000_000, "attempt": 1, "handler": "synthetic",
    "instance": {}, "instance_id": "0", "sample_index": 0, "client_id": "bench-client-0123456789",
    "budget_s": 3600.0, "phase_limits": {}, "spent_s": 0.0, "timing": {"queue": 0.0001},
    "state": {}, "sandbox": None, "trajectory": {}, "node": "vm", "sent_at": 1.7e9,
}


def _watch_stdin():
    def run():
        try:
            sys.stdin.read()
        finally:
            os._exit(0)

    threading.Thread(target=run, daemon=True).start()
    threading.Timer(120.0, lambda: os._exit(0)).start()


def serve_echo(addr: str):
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    s.bind(addr)
    print("ready", flush=True)
    while True:
        ident, body = s.recv_multipart()
        s.send_multipart([ident, msgpack.packb(msgpack.unpackb(body))])


def serve_forward(addr_in: str, addr_out: str, hwm: int = 1):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.rcvhwm = hwm
    pull.linger = 0
    pull.bind(addr_in)
    push = ctx.socket(zmq.PUSH)
    push.sndhwm = hwm
    push.linger = 0
    push.connect(addr_out)
    print("ready", flush=True)
    while True:
        push.send(msgpack.packb(msgpack.unpackb(pull.recv())))


def _spawn(*args) -> subprocess.Popen:
    from rolloutd.daemons.children import die_with_parent  # the parent's side only: the helpers stay raw

    p = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         preexec_fn=die_with_parent)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"raw zmq helper {args} did not start")
    return p


def _stop(procs):
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def ping_pong(tmp: str, n: int = 3000, warmup: int = 300) -> list[float]:
    """Round-trip times in seconds (DEALER -> ROUTER echo -> DEALER, msgpack both sides)."""
    addr = f"ipc://{tmp}/raw-echo.sock"
    srv = _spawn("echo", addr)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(addr)
    out = []
    try:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            s.send(msgpack.packb(PAYLOAD))
            msgpack.unpackb(s.recv())
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    finally:
        s.close()
        ctx.term()
        _stop([srv])
    return out


def chain(tmp: str, n: int = 20000, window: int = 256, hops: int = 3) -> float:
    """Messages per second through ``hops`` forwarder processes and back (PUSH/PULL, HWM 1)."""
    addrs = [f"ipc://{tmp}/raw-chain-{i}.sock" for i in range(hops + 1)]
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.linger = 0
    sink.bind(addrs[-1])
    procs = [_spawn("forward", addrs[i], addrs[i + 1]) for i in range(hops)]
    src = ctx.socket(zmq.PUSH)
    src.linger = 0
    src.sndhwm = 1
    src.connect(addrs[0])
    body = dict(PAYLOAD)
    poller = zmq.Poller()
    poller.register(sink, zmq.POLLIN)
    poller.register(src, zmq.POLLOUT)
    try:
        sent = got = 0
        t0 = time.perf_counter()
        while got < n:
            while sent < n and sent - got < window:
                body["job_id"] = sent
                try:
                    src.send(msgpack.packb(body), zmq.NOBLOCK)
                except zmq.Again:
                    break
                sent += 1
            if sent >= n or sent - got >= window:
                poller.modify(src, 0)
            else:
                poller.modify(src, zmq.POLLOUT)
            if dict(poller.poll(1000)).get(sink):
                while True:
                    try:
                        msgpack.unpackb(sink.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    got += 1
        dt = time.perf_counter() - t0
    finally:
        src.close()
        sink.close()
        ctx.term()
        _stop(procs)
    return n / dt


if __name__ == "__main__":
    _watch_stdin()
    if sys.argv[1] == "echo":
        serve_echo(sys.argv[2])
    elif sys.argv[1] == "forward":
        serve_forward(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
