"""Frames per message: a poll reply's results with every array in a frame of its own (ext 1)
against small arrays inside the header (ext 2, ``codec.INLINE_MAX_BYTES``), same run.

    python bench/bench_frames.py            # 256 results per reply, 0 / 200 / 2,000 tokens, 7 repeats
    python bench/bench_frames.py --quick    # 64 results, 0 / 200 tokens, 3 repeats

Per reply: ``codec.encode`` of ``{"results": [...]}`` (trajectories shaped like
``messages.empty_trajectory`` with ``tokens`` prompt and response ids, loss mask and logprobs),
``send_multipart`` on a PAIR socket over ipc, ``recv_multipart`` on its peer, ``codec.decode``.
Both ends live in this process, so ``time.process_time`` counts the sender, the receiver and
libzmq's I/O threads: CPU per result, whatever else the machine runs (its load still moves the
figures some percent). The two encodings alternate reply by reply; medians over the repeats.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import numpy as np
import zmq

from rolloutd.bus import codec
from rolloutd.bus.messages import empty_trajectory


def trajectories(n: int, tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        t = empty_trajectory(i, f"i{i}", 0)
        t["prompt_ids"] = np.arange(tokens, dtype="<i4")
        t["response_ids"] = np.arange(tokens, dtype="<i4")
        t["loss_mask"] = np.ones(tokens, dtype="|i1")
        t["logprobs"] = np.full(tokens, -0.5, dtype="<f4")
        out.append(t)
    return out


def one_reply(a, b, results: list, inline_max) -> tuple[float, int]:
    c0 = time.process_time()
    frames = codec.encode({"v": 1, "kind": "reply", "req_id": 1, "body": {"results": results}}, inline_max)
    a.send_multipart(frames, copy=False)
    if not b.poll(10_000):
        raise RuntimeError("the reply did not arrive")
    got = codec.decode(b.recv_multipart(copy=False))
    dt = time.process_time() - c0
    assert len(got["body"]["results"]) == len(results)
    return dt, len(frames)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", type=int, default=None, help="results per reply (default 256; quick 64)")
    ap.add_argument("--tokens", default=None, help="comma list (default 0,200,2000; quick 0,200)")
    ap.add_argument("--repeats", type=int, default=None, help="default 7; quick 3")
    ap.add_argument("--replies", type=int, default=20, help="replies per encoding per repeat")
    a = ap.parse_args()
    n = a.results or (64 if a.quick else 256)
    tokens = [int(x) for x in (a.tokens or ("0,200" if a.quick else "0,200,2000")).split(",")]
    repeats = a.repeats or (3 if a.quick else 7)
    tmp = common.short_tmpdir("rb-frames-")
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (tx, rx):
        s.setsockopt(zmq.LINGER, 0)
    tx.bind(f"ipc://{tmp}/p.sock")
    rx.connect(f"ipc://{tmp}/p.sock")
    print(f"frames per message: {n} results per reply, {a.replies} replies per encoding per repeat, "
          f"{repeats} repeats, CPU us per result (both ends + libzmq threads)")
    try:
        for tok in tokens:
            results = trajectories(n, tok)
            per = {"ext1": [], "inline": []}
            frames = {}
            for _ in range(repeats):
                tot = {"ext1": 0.0, "inline": 0.0}
                for _ in range(a.replies):
                    for name, lim in (("ext1", None), ("inline", codec.INLINE_MAX_BYTES)):
                        dt, frames[name] = one_reply(tx, rx, results, lim)
                        tot[name] += dt
                for name in tot:
                    per[name].append(tot[name] / a.replies / n * 1e6)
            e1, il = common.median(per["ext1"]), common.median(per["inline"])
            print(f"  {tok:5d} tokens: every array a frame ({frames['ext1']:5d} frames) {e1:7.1f} us | "
                  f"inline ({frames['inline']:4d} frames) {il:7.1f} us | inline/frames = {il / e1:.2f}")
    finally:
        tx.close()
        rx.close()
        ctx.term()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
