"""``rolloutd view``: the real CLI on results of a real ``rolloutd up``, the page in headless
Debian chromium (selenium + chromedriver from the system, no browser download)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.viewer.browser import console_errors, require_browser, start_browser

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def view(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "view", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def blocks(html: str) -> dict[str, object]:
    """The page's JSON blocks by id (what the script reads)."""
    out = {}
    for ident, body in re.findall(r'<script type="application/json" id="([^"]+)">(.*?)</script>', html, re.S):
        out[ident] = json.loads(body)
    return out


def results_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def browser():
    require_browser()
    drv = start_browser()
    yield drv
    drv.quit()


def open_page(drv, url: str, ready: str, timeout: float = 60):
    from selenium.webdriver.common.by import By

    drv.get(url)
    wait_for(lambda: drv.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == ready, timeout,
             what=f"the {ready} page of {url}")


def go(drv, hash_: str, ready: str):
    """Client-side navigation (a hash change), waiting for the page it renders."""
    from selenium.webdriver.common.by import By

    drv.execute_script("document.body.removeAttribute('data-ready'); location.hash = arguments[0];", hash_)
    wait_for(lambda: drv.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == ready, 30, what=hash_)


def test_every_job_and_status_of_a_real_batch_is_in_the_report(results_file, tok_dir, tmp_path):
    results = results_of(results_file)
    out = tmp_path / "r.html"
    view(str(results_file), "--tokenizer", tok_dir, "--out", str(out))
    b = blocks(out.read_text())
    rows, summary = b["rows"], b["summary"]
    assert len(rows) == len(results) == 9
    assert {r["status"] for r in rows} == {"ok", "failed", "timeout", "cancelled"}
    assert summary["by_status"] == {s: sum(r["status"] == s for r in results) for s in {r["status"] for r in results}}
    bad = next(r for r in rows if r["instance_id"] == "bad")
    assert bad["failed_phase"] == "init" and bad["error_type"], bad
    assert summary["failed_at"]["timeout@run"] == 1 and summary["failed_at"]["cancelled@" + next(
        r["failed_phase"] or "-" for r in results if r["status"] == "cancelled")] == 1
    # groups: the two samples of each math instance, zero variance exactly when their rewards agree
    for g in summary["groups"]:
        rewards = [r["reward"] for r in results if r["instance_id"] == g["group"] and r["status"] == "ok"]
        assert g["n"] == len(rewards) == 2
        assert g["zero_variance"] == (len(set(rewards)) == 1)
    # each detail record holds the result's tokens unchanged
    for r in rows:
        d = b[f"d-{r['i']}"]
        src = next(x for x in results if x["job_id"] == d["job_id"])
        assert d["segments"][0]["response_ids"] == src["response_ids"]
        assert d["segments"][0]["loss_mask"] == src["loss_mask"]
    assert b["meta"]["tokenizer"] == tok_dir and b["vocab"]


def test_the_page_shows_what_the_model_was_trained_on(results_file, tok_dir, tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from rolloutd.llm.tokenizer_utils import load_tokenizer

    tok = load_tokenizer(tok_dir)
    results = results_of(results_file)
    out = tmp_path / "r.html"
    view(str(results_file), "--tokenizer", tok_dir, "--out", str(out))
    url = out.as_uri()
    open_page(browser, url, "overview")
    rows = browser.find_elements(By.CSS_SELECTOR, "#rows tr")
    assert len(rows) == len(results)
    # filters
    Select(browser.find_element(By.ID, "f-status")).select_by_value("failed")
    shown = browser.find_elements(By.CSS_SELECTOR, "#rows tr")
    assert [t.find_elements(By.CSS_SELECTOR, ".badge")[0].text for t in shown] == ["failed"] * sum(
        r["status"] == "failed" for r in results)
    Select(browser.find_element(By.ID, "f-status")).select_by_value("")
    browser.find_element(By.ID, "f-search").send_keys("m1")
    assert {t.find_elements(By.TAG_NAME, "td")[2].text for t in browser.find_elements(By.CSS_SELECTOR, "#rows tr")} == {"m1"}
    browser.find_element(By.ID, "f-search").clear()
    browser.find_element(By.ID, "f-search").send_keys(" ")  # an input event with the box empty again
    browser.find_element(By.ID, "f-search").clear()
    # every trajectory page: loss-bearing tokens are exactly the result's loss_mask == 1 positions
    idx = {r["job_id"]: i for i, r in enumerate(blocks(out.read_text())["rows"])}
    idx = {json.loads(json.dumps(k)): v for k, v in idx.items()}
    for r in results:
        i = idx[r["job_id"]]
        go(browser, f"#/t/{i}", "traj")
        shown = {int(e.get_attribute("data-j")) for e in browser.find_elements(By.CSS_SELECTOR, ".tok.s")}
        assert shown == {j for j, m in enumerate(r["loss_mask"]) if m == 1}, r["instance_id"]
        badge = browser.find_element(By.CSS_SELECTOR, "#traj h2 .badge").text
        assert badge == r["status"]
        if r["status"] != "ok":
            assert r["error"]["type"] in browser.find_element(By.ID, "error").text
        for k, t in enumerate(r["turns"]):  # the chat shows each sampled span decoded from its ids
            a, b = t["span"]
            text = browser.find_element(By.CSS_SELECTOR, f'.msg.assistant[data-turn="{k}"] pre').get_attribute("textContent")
            assert text == tok.decode(r["response_ids"][a:b], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert not console_errors(browser), console_errors(browser)


def test_result_text_cannot_script_the_page(results_file, tok_dir, tmp_path, browser):
    """A tool output or error is data: ``</script>`` and HTML in it are shown, never run."""
    from selenium.webdriver.common.by import By

    r = results_of(results_file)[0]
    evil = "</script><script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\">"
    r.update(status="failed", failed_phase="eval", error={"type": "Boom", "message": evil}, eval_details={"output": evil})
    src = tmp_path / "evil.jsonl"
    src.write_text(json.dumps(r) + "\n")
    out = tmp_path / "evil.html"
    view(str(src), "--tokenizer", tok_dir, "--out", str(out))
    open_page(browser, out.as_uri() + "#/t/0", "traj")
    assert browser.execute_script("return window.pwned === undefined")
    assert evil in browser.find_element(By.ID, "error").text
    assert json.dumps(evil) in browser.find_element(By.ID, "eval").get_attribute("textContent")  # shown as JSON
    assert not console_errors(browser)


def test_non_canonical_splits_are_marked(results_file, tok_dir, tmp_path, browser):
    """A turn sampled as one token per character decodes to text whose own encoding is shorter:
    the page marks exactly the sampled positions that differ."""
    from selenium.webdriver.common.by import By

    from rolloutd.daemons.viewer.report import Canon
    from rolloutd.llm.tokenizer_utils import load_tokenizer

    tok = load_tokenizer(tok_dir)
    text = " the answer is forty two"
    canon = tok.encode(text, add_special_tokens=False)
    split = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert split != canon and tok.decode(split) == text
    assert Canon(tok).positions(canon) == []
    marked = Canon(tok).positions(split)
    assert marked and set(marked) <= set(range(len(split)))
    r = results_of(results_file)[0]
    resp = canon + split
    r.update(response_ids=resp, loss_mask=[1] * len(resp), logprobs=[-0.5] * len(resp),
             turns=[{"index": 0, "span": [0, len(canon)], "policy_version": 0, "finish_reason": "stop"},
                    {"index": 1, "span": [len(canon), len(resp)], "policy_version": 1, "finish_reason": "stop",
                     "continuation": True}])
    r.pop("segments", None)
    src = tmp_path / "nc.jsonl"
    src.write_text(json.dumps(r) + "\n")
    out = tmp_path / "nc.html"
    view(str(src), "--tokenizer", tok_dir, "--out", str(out))
    open_page(browser, out.as_uri() + "#/t/0", "traj")
    got = sorted(int(e.get_attribute("data-j")) for e in browser.find_elements(By.CSS_SELECTOR, ".tok.nc"))
    assert got == [len(canon) + p for p in marked]
    marks = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".turnmark")]
    assert marks == ["turn 0 · v0", "turn 1 · v1 · cont"]


def test_harness_segments_each_get_their_tokens(results_file, tok_dir, tmp_path, browser):
    """A harness episode with two segments (the top level is the last one) shows both, each with
    its own loss-bearing tokens."""
    from selenium.webdriver.common.by import By

    ok = [r for r in results_of(results_file) if r["status"] == "ok"][:2]
    seg = [{k: r[k] for k in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "turns")} | {"index": i}
           for i, r in enumerate(ok)]
    r = dict(ok[1], handler="harness", segments=seg)
    src = tmp_path / "h.jsonl"
    src.write_text(json.dumps(r) + "\n")
    out = tmp_path / "h.html"
    view(str(src), "--tokenizer", tok_dir, "--out", str(out))
    open_page(browser, out.as_uri() + "#/t/0", "traj")
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "h2.segment")] == ["segment 0 of 2", "segment 1 of 2"]
    for si, s in enumerate(seg):
        shown = {int(e.get_attribute("data-j")) for e in browser.find_elements(By.CSS_SELECTOR, f"#tokens-{si} .tok.s")}
        assert shown == {j for j, m in enumerate(s["loss_mask"]) if m == 1}
    assert not console_errors(browser)


def test_ten_thousand_trajectories_open_and_page(results_file, tok_dir, tmp_path, browser):
    """The generator streams; the page parses a trajectory only when it is opened and shows 100
    rows at a time. Bound generous (a hang or a quadratic page fails it); the measured figure is
    bench/bench_view.py's."""
    from selenium.webdriver.common.by import By

    base = [r for r in results_of(results_file) if r["status"] == "ok"]
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for k in range(10_000):
            r = dict(base[k % len(base)], job_id=10_000_000 + k, instance_id=f"g{k // 4}", sample_index=k % 4)
            f.write(json.dumps(r) + "\n")
    out = tmp_path / "big.html"
    view(str(src), "--tokenizer", tok_dir, "--out", str(out), "--no-canonical")
    t0 = time.monotonic()
    open_page(browser, out.as_uri(), "overview", timeout=120)
    took = time.monotonic() - t0
    print(f"10,000 trajectories: overview ready in {took:.2f} s ({out.stat().st_size / 1e6:.1f} MB)")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rows tr")) == 100
    assert "of 10000 trajectories" in browser.find_element(By.ID, "page-info").text
    go(browser, "#/t/9999", "traj")
    assert browser.find_element(By.CSS_SELECTOR, "#traj").get_attribute("data-i") == "9999"
    assert not console_errors(browser)


def test_the_tokenizer_named_in_the_results_decodes_them(results_file, tok_dir, tmp_path):
    """Domain handlers name their tokenizer in metrics.tokenizer; without --tokenizer the viewer
    decodes with it."""
    results = results_of(results_file)
    assert {r["metrics"].get("tokenizer") for r in results if r["handler"] == "math" and r["status"] == "ok"} == {tok_dir}
    out = tmp_path / "named.html"
    p = view(str(results_file), "--out", str(out))
    assert f"tokenizer {tok_dir}" in p.stderr
    b = blocks(out.read_text())
    assert b["meta"]["tokenizer"] == tok_dir and b["vocab"]


def test_without_a_tokenizer_ids_are_shown(results_file, tmp_path):
    rows = [json.loads(line) for line in results_file.read_text().splitlines()]
    for r in rows:
        r.get("metrics", {}).pop("tokenizer", None)
    src = tmp_path / "anon.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ids.html"
    p = view(str(src), "--out", str(out))
    assert "token ids are shown as numbers" in p.stderr
    b = blocks(out.read_text())
    assert b["vocab"] == {} and b["meta"]["tokenizer"] == ""


def test_bad_input_is_reported_not_fatal(tmp_path, tok_dir):
    src = tmp_path / "mixed.jsonl"
    src.write_text('{"status": "ok", "job_id": 1, "response_ids": [1, 2], "loss_mask": [1, 0], "turns": []}\n'
                   "not json\n[1, 2]\n\n")
    out = tmp_path / "m.html"
    view(str(src), "--tokenizer", tok_dir, "--out", str(out))
    rows = blocks(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "unreadable", "unreadable"]
    p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "view", str(tmp_path / "missing.jsonl")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no such file" in p.stderr


def test_serve_follows_a_growing_file(results_file, tok_dir, tmp_path):
    """``--serve`` re-reads the JSONL on every load (submit writes a line per result) and says
    when the gateway does not answer; it binds loopback only."""
    lines = results_file.read_text().splitlines(keepends=True)
    src = tmp_path / "live.jsonl"
    src.write_text("".join(lines[:2]))
    p = subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", "view", str(src), "--serve", "--port", "0",
                          "--tokenizer", tok_dir, "--gateway", f"ipc://{tmp_path}/none.sock"],
                         cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        end = time.monotonic() + 120
        while url is None and time.monotonic() < end:
            line = p.stderr.readline()
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line or "")
            url = m.group(1) if m else url
            assert line or p.poll() is None, "view --serve exited"
        assert url, "no address printed"

        def count():
            with urllib.request.urlopen(url, timeout=30) as resp:
                return len(blocks(resp.read().decode())["rows"])

        assert count() == 2
        with open(src, "a") as f:
            f.writelines(lines[2:])
        assert count() == len(lines)
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert "no answer" in blocks(resp.read().decode())["meta"]["live"]["status"]
    finally:
        p.terminate()
        p.wait(timeout=30)
        p.stderr.close()
    assert os.path.exists(src)
