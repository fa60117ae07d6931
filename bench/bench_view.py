"""``rolloutd view`` on large results files: how long the page takes to write and to open.

Same run, same file, two baselines:
* writing: the viewer's streaming writer against just ``json.loads`` of every line (the least
  any reader of the JSONL pays);
* opening: headless Debian chromium opening the viewer page until its overview is drawn,
  against opening a page with the same data blocks and no script (the browser's parse of the
  bytes alone); then opening the last trajectory's page.

Trajectories are shaped like the demo's (a templated prompt, three sampled turns with tool
calls and observations) with the tiny model's tokenizer; medians over the repeats.

    python bench/bench_view.py            # 10,000 trajectories, 3 repeats
    python bench/bench_view.py --quick    # 1,000, 1 repeat
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from common import REPO, machine, median, revision, short_tmpdir

sys.path.insert(0, str(REPO))


def make_results(path: Path, n: int, tok) -> None:
    rng = random.Random(7)
    words = "the a fix test bug file line value return error pass fail python function call".split()
    prompt = tok.apply_chat_template([{"role": "system", "content": "You fix bugs."},
                                      {"role": "user", "content": "Fix the failing test in src/app.py."}],
                                     tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    with open(path, "w") as f:
        for k in range(n):
            resp, mask, lps, turns = [], [], [], []
            for t in range(3):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
                ids = tok.encode(text + '\n<tool_call>{"name": "bash"}</tool_call>', add_special_tokens=False)
                a = len(resp)
                resp += ids
                mask += [1] * len(ids)
                lps += [round(-rng.expovariate(2.0), 4) for _ in ids]
                obs = tok.encode("\n<tool_response>" + " ".join(rng.choice(words) for _ in range(60)) + "</tool_response>\n",
                                 add_special_tokens=False) if t < 2 else []
                turns.append({"index": t, "span": [a, a + len(ids)], "finish_reason": "stop", "policy_version": 0,
                              "obs_start": a + len(ids) if obs else None, "obs_end": a + len(ids) + len(obs) if obs else None})
                resp += obs
                mask += [0] * len(obs)
                lps += [0.0] * len(obs)
            r = {"job_id": 1000 + k, "instance_id": f"task-{k // 8}", "sample_index": k % 8, "handler": "swe",
                 "status": "ok" if k % 50 else "failed", "failed_phase": None if k % 50 else "run",
                 "error": None if k % 50 else {"type": "BackendError", "message": "backend went away"},
                 "reward": float(rng.random() < 0.5), "eval_details": {"resolved": True}, "prompt_ids": prompt,
                 "response_ids": resp, "loss_mask": mask, "logprobs": lps, "turns": turns,
                 "metrics": {"turns": 3}, "timing": {"queue": 0.01, "init": 0.9, "run": 2.5, "eval": 1.2},
                 "attempts": 1, "policy_version": 0, "stale": False, "node": "n1"}
            f.write(json.dumps(r) + "\n")


def bare_page(html: str) -> str:
    """The same data blocks, no script: what the browser pays to parse the bytes."""
    data = "".join(re.findall(r'<script type="application/json".*?</script>\n', html, re.S))
    return f"<!DOCTYPE html><html><body><p id=x>bare</p>{data}</body></html>"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("-n", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    n = args.n or (1000 if args.quick else 10_000)
    reps = args.repeats or (1 if args.quick else 3)

    from rolloutd.daemons.viewer import page
    from rolloutd.backends.tiny_model import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    work = short_tmpdir("rb-view-")
    src = work / "results.jsonl"
    make_results(src, n, tok)
    print(f"# bench_view: {n} trajectories ({src.stat().st_size / 1e6:.1f} MB JSONL), {reps} repeat(s); "
          f"{machine()}; {revision(REPO)}")

    base_w, view_w, view_wc = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        with open(src) as f:
            for line in f:
                json.loads(line)
        base_w.append(time.perf_counter() - t)
        t = time.perf_counter()
        buf = io.StringIO()
        page.write(str(src), buf, tok, canonical=False)
        view_w.append(time.perf_counter() - t)
        t = time.perf_counter()
        buf = io.StringIO()
        page.write(str(src), buf, tok, canonical=True)
        view_wc.append(time.perf_counter() - t)
    html = buf.getvalue()
    out = work / "view.html"
    out.write_text(html)
    bare = work / "bare.html"
    bare.write_text(bare_page(html))
    print(f"write: json.loads only {median(base_w):.2f} s; viewer {median(view_w):.2f} s "
          f"({median(view_w) / median(base_w):.1f}x); with the non-canonical check {median(view_wc):.2f} s "
          f"({median(view_wc) / median(base_w):.1f}x); page {out.stat().st_size / 1e6:.1f} MB")

    if not (os.path.exists("/usr/bin/chromium") and os.path.exists("/usr/bin/chromedriver")):
        print("open: skipped (no /usr/bin/chromium + chromedriver: apt-get install chromium chromium-driver)")
        return 0
    from tests.viewer.browser import start_browser

    drv = start_browser()
    try:
        bare_t, ov_t, tr_t = [], [], []
        for _ in range(reps):
            t = time.perf_counter()
            drv.get(bare.as_uri())
            drv.find_element("id", "x")
            bare_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            drv.get(out.as_uri())
            while drv.execute_script("return document.body.getAttribute('data-ready')") != "overview":
                time.sleep(0.01)
            ov_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            drv.execute_script(f"document.body.removeAttribute('data-ready'); location.hash = '#/t/{n - 1}';")
            while drv.execute_script("return document.body.getAttribute('data-ready')") != "traj":
                time.sleep(0.01)
            tr_t.append(time.perf_counter() - t)
    finally:
        drv.quit()
    print(f"open: bare page {median(bare_t):.2f} s; viewer overview {median(ov_t):.2f} s "
          f"({median(ov_t) / median(bare_t):.2f}x); a trajectory page {median(tr_t) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
