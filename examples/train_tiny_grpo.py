#!/usr/bin/env python
"""A real RL loop on CPU through rolloutd: GRPO on a tiny Qwen2 policy, checkpoints swapped
through the gateway after every update.

What it learns: to answer in digits. Each step has 8 instances (chat prompts "Reply with
digits only: <number>") x 8 samples; the ``toy`` handler's reward is the fraction of the (up
to 8) sampled tokens that are one of the ten digit tokens. The policy is a randomly
initialised 130k-parameter Qwen2 (``make_tiny_model``): it emits a digit in ~2-3% of its
tokens at first, enough for most GRPO groups to contain better and worse samples; the update
raises the digit tokens' logits everywhere (tied embeddings), and the reward climbs to ~1
within 5-8 updates at Adam lr 1e-2 (seeds 0-5 checked).

Every step::

    rollouts:  BatchClient.submit(batch instances x n samples) -> rolloutd up -> toy handler
               -> serve-hf backend (policy version k) -> trajectories (token ids + logprobs)
    check:     every trajectory says policy_version == k, and the trainer's own logprobs of
               the sampled tokens (same weights, temperature 1) match the service's to < 1e-3
               (the importance ratio is 1: the data is on-policy)
    update:    GRPO (group-normalised outcome advantage, token-mean PPO-clip loss, 1 epoch)
    swap:      save checkpoint v{k+1}; start `rolloutd serve-hf v{k+1}` on a new port; then
               clear_backends() + add_backend(new_url, policy_version=k+1); stop the old server
               (``--swap reload``: load v{k+1} into the running server instead, if it has
               ``/update_weights_from_disk``, and re-register it with the new version)

Run (CI-sized, ~1-2 min on 2 cores)::

    python examples/train_tiny_grpo.py --steps 8 --out /tmp/grpo

Longer, by hand (reward 0.02 -> 1.0 over 20 steps at the lower learning rate, ~4 min)::

    python examples/train_tiny_grpo.py --steps 20 --lr 3e-3 --out /tmp/grpo-long

It prints one ``STEP {json}`` line per step and a final ``SUMMARY {json}`` line, writes
``metrics.jsonl`` in ``--out``, and stops everything it started (also on Ctrl-C / SIGTERM).
Exit status: 0 on success, 1 when a check failed (logprob mismatch, wrong policy version,
no ok trajectories).

The ``toy`` handler is a ``rolloutd.handlers`` entry point of the rolloutd distribution. Run
from a source tree that is not installed, this script registers it for the ``rolloutd up`` it
starts only, through a throw-away ``*.dist-info`` on PYTHONPATH, and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rolloutd.daemons.children import die_with_parent  # noqa: E402

LOGPROB_TOL = 1e-3


def log(msg: str):
    print(msg, flush=True)


# -- child processes ------------------------------------------------------------------------

class Child:
    """A subprocess we own: started with PDEATHSIG, stopped with SIGTERM then SIGKILL."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict | None = None, capture: bool = False):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else self._log, stderr=self._log,
                                     stdin=subprocess.DEVNULL, env=env, cwd=REPO, preexec_fn=die_with_parent)

    def read_line(self, prefix: str, timeout_s: float) -> str:
        """The first stdout line that starts with ``prefix`` (e.g. serve-hf's ``READY <port>``)."""
        deadline = time.monotonic() + timeout_s
        buf = b""
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            r, _, _ = select.select([fd], [], [], 0.2)
            if not r:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
        raise RuntimeError(f"{self.name} did not print {prefix!r} within {timeout_s}s "
                           f"(exit {self.proc.poll()}); see {self.log_path}:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


def toy_entry_point_env(workdir: Path) -> tuple[dict, bool]:
    """The environment for ``rolloutd up``; registers ``toy`` via a dist-info shim if it is not installed."""
    from rolloutd.handlers.registry import handler_names

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "toy" in handler_names():
        return env, False
    shim = workdir / "entry_point_shim"
    di = shim / "rolloutd_trainer_toy-0.0.0.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: rolloutd-trainer-toy\nVersion: 0.0.0\n")
    (di / "entry_points.txt").write_text('[rolloutd.handlers]\ntoy = rolloutd.handlers.toy:ToyHandler\n')
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env, True


def start_rolloutd(workdir: Path, run_pool: int, env: dict) -> tuple[Child, str]:
    rd = Path(tempfile.mkdtemp(prefix="rd-grpo-", dir="/tmp"))  # ipc paths must stay short
    cmd = [sys.executable, "-m", "rolloutd.daemons.cli", "up", "--runtime-dir", str(rd / "run"),
           "--set", f"run.pool={run_pool}", "--set", "init.pool=64", "--set", "eval.pool=64",
           "--set", "router.max_policy_lag=0", "--set", "logging.level=warning"]
    up = Child("rolloutd up", cmd, workdir / "rolloutd_up.log", env=env)
    up.runtime_root = rd
    gateway = f"ipc://{rd}/run/gateway.sock"
    from rolloutd.daemons.supervisor import wait_ready

    try:
        st = wait_ready(gateway, 60.0)
    except TimeoutError:
        up.stop()
        shutil.rmtree(rd, ignore_errors=True)
        raise RuntimeError(f"rolloutd up did not become ready:\n{up.tail()}")
    except BaseException:
        up.stop()
        shutil.rmtree(rd, ignore_errors=True)
        raise
    if "toy" not in st.get("handlers", []):
        up.stop()
        shutil.rmtree(rd, ignore_errors=True)
        raise RuntimeError(f"the gateway does not know the toy handler (handlers: {st.get('handlers')})")
    return up, gateway


def start_server(model_dir: Path, workdir: Path, version: int, threads: int) -> tuple[Child, str]:
    cmd = [sys.executable, "-m", "rolloutd.daemons.cli", "serve-hf", str(model_dir), "--port", "0",
           "--served-model-name", "tiny-policy", "--max-batch-size", "64", "--threads", str(threads)]
    srv = Child(f"serve-hf v{version}", cmd, workdir / f"serve_hf_v{version}.log", capture=True)
    try:
        port = int(srv.read_line("READY", 120.0).split()[1])
    except BaseException:  # also Ctrl-C / SIGTERM while it starts: never leave it behind
        srv.stop()
        raise
    log(f"serve-hf v{version}: http://127.0.0.1:{port} ({model_dir.name})")
    return srv, f"http://127.0.0.1:{port}"


def reload_weights(url: str, model_dir: Path) -> bool:
    """Ask the server to load ``model_dir`` in place (SGLang's ``/update_weights_from_disk``).
    False when it has no such endpoint (then the caller restarts it)."""
    import httpx

    try:
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(model_dir)}, timeout=120.0)
    except httpx.HTTPError as e:
        raise RuntimeError(f"reloading {url}: {e}") from e
    if r.status_code == 404:
        return False
    if r.status_code != 200:
        raise RuntimeError(f"reloading {url} failed: HTTP {r.status_code} {r.text[:300]}")
    return True


# -- the task --------------------------------------------------------------------------------
def make_tasks(renderer, rng: random.Random, step: int, batch: int, max_tokens: int, seed: int,
               digit_ids: list[int]) -> list[dict]:
    tasks = []
    for b in range(batch):
        x = rng.randrange(10, 10_000)
        prompt = renderer.render_prompt([{"role": "user", "content": f"Reply with digits only: {x}"}])
        tasks.append({
            "handler": "toy",
            "instance_id": f"s{step}-i{b}",
            "instance": {
                "prompt_ids": [int(t) for t in prompt],
                "target_ids": digit_ids,
                "reward": "fraction",
                # seeds make a run repeatable; sample k of an instance uses seed + k
                "sampling": {"max_tokens": max_tokens, "temperature": 1.0,
                             "seed": (seed * 1_000_003 + step * 1009 + b * 101) % (2 ** 31)},
            },
            "timeout_s": 120.0,
        })
    return tasks


# -- the trainer -----------------------------------------------------------------------------
def sequence_logprobs(model, arrays_t, P: int):
    """log p(response token j) under ``model``, [B, R]; same layout as ``collate``."""
    import torch

    out = model(input_ids=arrays_t["input_ids"], attention_mask=arrays_t["attention_mask"],
                position_ids=arrays_t["position_ids"], use_cache=False)
    logits = out.logits[:, P - 1:-1, :].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, arrays_t["responses"].unsqueeze(-1)).squeeze(-1)


def train(args) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rolloutd.gateway.batch import BatchClient, collate, filter_ok, group_advantages, status_counts, to_torch
    from rolloutd.llm.conversation import get_renderer
    from rolloutd.backends.tiny_model import make_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / "checkpoints"
    if ckpt_root.exists():
        shutil.rmtree(ckpt_root)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.train_threads:
        torch.set_num_threads(args.train_threads)

    v0 = make_tiny_model(ckpt_root / "v0", seed=args.model_seed)
    tok = AutoTokenizer.from_pretrained(str(v0), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(v0), dtype=torch.float32, local_files_only=True)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    renderer = get_renderer(tok)
    digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert all(isinstance(i, int) and i >= 0 for i in digit_ids), digit_ids
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    children: list[Child] = []
    metrics_f = open(out / "metrics.jsonl", "w")
    history: list[dict] = []
    failures: list[str] = []
    runtime_dir = None
    t_start = time.monotonic()
    up = client = server = None
    try:
        env, shimmed = toy_entry_point_env(out)
        if shimmed:
            log("note: the 'toy' handler is not an installed entry point; registered it for this run only "
                "(pip install -e . registers it for good)")
        up, gateway = start_rolloutd(out, args.batch * args.n, env)
        children.append(up)
        runtime_dir = str(up.runtime_root)
        log(f"rolloutd up: gateway {gateway}")
        server, url = start_server(v0, out, 0, args.server_threads)
        children.append(server)
        client = BatchClient(gateway, poll_wait_s=0.5)
        client.swap_backends([url], policy_version=0)
        rng = random.Random(args.seed)
        for step in range(args.steps):
            version = step
            t0 = time.monotonic()
            tasks = make_tasks(renderer, rng, step, args.batch, args.max_tokens, args.seed, digit_ids)
            trajs = client.gather(client.submit(tasks, n=args.n, deadline_s=args.deadline))
            t_roll = time.monotonic() - t0
            counts = status_counts(trajs)
            good = filter_ok(trajs)  # infrastructure failures never reach the model (they may have no tokens)
            if not good:
                raise RuntimeError(f"step {step}: no ok trajectories ({counts}); first error: "
                                   f"{next((t['error'] for t in trajs if t['error']), None)}")
            trajs = good
            arrays = collate(trajs, pad_id=pad_id)
            ok = arrays["status"]
            versions = sorted({int(v) for v in arrays["policy_versions"][ok]})
            if versions != [version]:
                failures.append(f"step {step}: trajectories from policy versions {versions}, expected [{version}]")
            adv = group_advantages(trajs)
            at = to_torch(arrays)
            P = arrays["prompts"].shape[1]
            mask = at["loss_mask"].float()
            old = at["rollout_logprobs"]

            t1 = time.monotonic()
            model.train()
            new_lp = sequence_logprobs(model, at, P)
            with torch.no_grad():
                diff = ((new_lp - old).abs() * mask).max().item()
            if not diff < LOGPROB_TOL:
                failures.append(f"step {step}: trainer vs service logprobs differ by {diff:.3g} (>= {LOGPROB_TOL})")
            ratio = torch.exp(new_lp - old)          # == 1 on-policy; the gradient is A * grad log p
            a = torch.from_numpy(adv).unsqueeze(1)
            pg = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * a)
            loss = (pg * mask).sum() / mask.sum().clamp(min=1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            opt.step()
            t_train = time.monotonic() - t1

            # checkpoint + swap: the new server must be up before the old one is cleared
            t2 = time.monotonic()
            ckpt = ckpt_root / f"v{version + 1}"
            model.save_pretrained(str(ckpt))
            tok.save_pretrained(str(ckpt))
            how = "restart"
            if args.swap == "reload" and reload_weights(url, ckpt):
                how = "reload"  # same server, new weights: re-register it under the new version
                client.swap_backends([url], policy_version=version + 1)
            else:
                if args.swap == "reload":
                    log("note: this serve-hf has no /update_weights_from_disk; restarting it instead")
                    args.swap = "restart"
                new_server, new_url = start_server(ckpt, out, version + 1, args.server_threads)
                children.append(new_server)
                client.swap_backends([new_url], policy_version=version + 1)
                server.stop()
                children.remove(server)
                server, url = new_server, new_url
            if not args.keep_checkpoints and version >= 1:
                shutil.rmtree(ckpt_root / f"v{version - 1}", ignore_errors=True)
            t_swap = time.monotonic() - t2

            rewards = arrays["rewards"][ok]
            rec = {"step": step, "policy_version": version, "reward_mean": round(float(rewards.mean()), 4),
                   "reward_std": round(float(rewards.std()), 4), "n_ok": int(ok.sum()), "n": sum(counts.values()),
                   "status": counts, "trained_on_versions": versions, "logprob_max_abs_diff": float(f"{diff:.3g}"),
                   "loss": round(float(loss.item()), 5), "grad_norm": round(gnorm, 4),
                   "response_len_mean": round(float(arrays["response_lengths"][ok].mean()), 2),
                   "rollout_s": round(t_roll, 2), "train_s": round(t_train, 2), "swap_s": round(t_swap, 2),
                   "swap": how}
            history.append(rec)
            metrics_f.write(json.dumps(rec) + "\n")
            metrics_f.flush()
            log("STEP " + json.dumps(rec))
    finally:
        if client is not None:
            try:
                client.close()
            except Exception as e:  # noqa: BLE001
                log(f"warning: closing the client: {e}")
        for c in reversed(children):
            rc = c.stop()
            if c is up and rc not in (0, None):
                log(f"warning: rolloutd up exited {rc}:\n{c.tail()}")
        if up is not None:
            shutil.rmtree(up.runtime_root, ignore_errors=True)
        metrics_f.close()
    curve = [h["reward_mean"] for h in history]
    k = min(2, max(1, len(curve) // 2))
    summary = {"steps": len(history), "reward_curve": curve,
               "first_mean": round(sum(curve[:k]) / k, 4), "last_mean": round(sum(curve[-k:]) / k, 4),
               "max_logprob_diff": max((h["logprob_max_abs_diff"] for h in history), default=None),
               "versions_ok": all(h["trained_on_versions"] == [h["policy_version"]] for h in history),
               "failures": failures, "wall_s": round(time.monotonic() - t_start, 1),
               "seed": args.seed, "lr": args.lr, "batch": args.batch, "n": args.n, "runtime_dir": runtime_dir}
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="GRPO updates (default 8: CI-sized)")
    p.add_argument("--batch", type=int, default=8, help="instances per step")
    p.add_argument("--n", type=int, default=8, help="samples per instance (the GRPO group)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--out", default="out/train_tiny_grpo", help="checkpoints, logs, metrics.jsonl")
    p.add_argument("--seed", type=int, default=0, help="sampling, data and torch seed")
    p.add_argument("--model-seed", type=int, default=0, help="seed of the random initial policy")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--deadline", type=float, default=300.0, help="per-batch deadline, seconds")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads of each serve-hf")
    p.add_argument("--train-threads", type=int, default=0, help="torch threads of the trainer (0: default)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--swap", choices=("restart", "reload"), default="restart",
                   help="restart: a new serve-hf per checkpoint (blue/green); reload: POST "
                        "/update_weights_from_disk to the running one (falls back to restart when absent)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):  # run the cleanup in train()'s finally
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    summary = train(args)
    log("SUMMARY " + json.dumps(summary))
    return 1 if summary["failures"] or summary["steps"] < args.steps else 0


if __name__ == "__main__":
    sys.exit(main())
