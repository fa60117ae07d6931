"""``rolloutd serve-hf MODEL_DIR --port P``: a small vLLM-compatible server around a
transformers causal LM (torch, CPU or one GPU).

HTTP (stdlib ``ThreadingHTTPServer``, HTTP/1.1 keep-alive):

* ``POST /v1/completions``: the subset of vLLM's OpenAI completions API used by
  :class:`rolloutd.llm.client.LLMClient`: ``prompt`` as a list of token ids, ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_token_ids``, ``ignore_eos``,
  ``logprobs`` (0: the sampled token's logprob), ``return_token_ids``,
  ``return_tokens_as_token_ids``. Reply shaped like vLLM's (``choices[0].token_ids``,
  ``prompt_token_ids``, ``logprobs.token_logprobs``, ``finish_reason`` in stop/length/abort,
  ``stop_reason``, ``usage``); errors like vLLM's (``{"error": {"message", "type", "code"}}``,
  HTTP 400 "This model's maximum context length is ..." when prompt + max_tokens does not fit).
  ``"stream": true`` answers as vLLM's ``completion_stream_generator`` (checked against its source):
  ``text/event-stream``, chunked, one ``data: {chunk}`` event with the tokens decoded since the
  last one, every 20 ms (vLLM sends one per decode step, and merges steps for a slow reader),
  ``prompt_token_ids`` on the first chunk, ``finish_reason`` on the last, a ``"choices": []`` usage
  chunk with ``stream_options.include_usage``, then ``data: [DONE]``; a client that closes the
  stream aborts the request (backends/scripted.py streams the same shape).
* ``POST /generate``: SGLang's native API (``input_ids``, ``sampling_params``,
  ``return_logprob``), reply with ``output_ids`` and ``meta_info.output_token_logprobs``.
* ``GET /health`` (and SGLang's ``/health_generate``), ``GET /v1/models``, ``GET /metrics`` (prometheus-client:
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, and SGLang's names).

Engine: one scheduler thread collects queued requests into a batch (up to
``--max-batch-size``), left-pads the prompts, runs one prefill and then decode steps with
the KV cache for the whole batch; each request completes (and is answered) as soon as it
stops, requests that arrive mid-batch wait for the next batch ("static" batching). A
client that closes its connection aborts its request: the handler thread polls the
socket while waiting, and the scheduler drops the row at the next step.

Logprobs are those of the distribution actually sampled from: temperature is applied,
then top-k, then top-p (renormalized), and the returned logprob is
``log_softmax(processed_logits)[token]``. With temperature 1 and no top-k/top-p it is exactly
``log_softmax(logits)[token]`` (what a trainer recomputes). Greedy (temperature 0) returns
``log_softmax(logits)`` of the argmax. (vLLM's default is the raw, unprocessed logprobs.)
All math is float32.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import select
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import structlog

from .vllm_replies import (completion_body, context_max_tokens, cut_at_stop_string, first_stop_string, load_gauges,
                           model_info_body, models_body, reply_text, sglang_generate_body, stream_chunk, stream_usage)

log = structlog.get_logger("rolloutd.llm")

__all__ = ["HFServer", "main"]


class _Req:
    __slots__ = (
        "rid",
        "api",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_ids",
        "eos_ids",
        "out_ids",
        "out_lps",
        "finish",
        "stop_reason",
        "done",
        "aborted",
        "created",
        "gen",
        "stop_strs",
        "include_stop",
    )

    def __init__(self, api: str, prompt: list[int], max_tokens: int, temperature: float, top_p: float, top_k: int,
                 seed: int | None, stop_ids: list[int], eos_ids: set[int], stop_strs: list[str] | None = None,
                 include_stop: bool = False) -> None:
        self.rid = uuid.uuid4().hex
        self.api = api
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self.stop_ids = set(stop_ids)
        self.eos_ids = eos_ids
        self.stop_strs = list(stop_strs or [])  # vLLM's `stop`: ends at the token completing one
        self.include_stop = include_stop
        self.out_ids: list[int] = []
        self.out_lps: list[float] = []
        self.finish: str | None = None
        self.stop_reason: int | str | None = None
        self.done = threading.Event()
        self.aborted = False
        self.created = time.time()
        self.gen: Any = None


class HFServer:
    """The engine plus its HTTP front end. ``start()`` returns the port (threads inside)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        served_model_name: str | None = None,
        device: str = "cpu",
        threads: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # pragma: no cover
            pass
        if threads:
            torch.set_num_threads(int(threads))
        self.torch = torch
        self.model_dir = str(model_dir)
        self.model_name = served_model_name or self.model_dir
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, local_files_only=True
        ).to(self.device).eval()
        cfg = self.model.config
        self.max_model_len = int(max_model_len or getattr(cfg, "max_position_embeddings", 4096))
        self.vocab_size = int(cfg.vocab_size)
        import inspect

        # transformers >= 5.x renamed `past_key_values` to `cache` (input and output)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # only the last position's logits are needed (saves the vocab projection of the prompt)
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        eos: set[int] = set()
        try:
            gc = GenerationConfig.from_pretrained(self.model_dir, local_files_only=True)
            e = gc.eos_token_id
        except Exception:
            e = getattr(cfg, "eos_token_id", None)
        if isinstance(e, int):
            eos.add(e)
        elif e:
            eos.update(int(x) for x in e)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = eos
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (min(eos) if eos else 0))
        self.max_batch_size = int(max_batch_size)
        self.host, self.port = host, int(port)
        self._queue: collections.deque[_Req] = collections.deque()
        self._cv = threading.Condition()
        self._running: list[_Req] = []
        self._model_lock = threading.Lock()  # held for a whole batch: a reload never splits one
        self._stop = False
        self._sched: threading.Thread | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self._registry, self._aborted_counter, self._tokens_counter = self._make_registry()

    # -- metrics ---------------------------------------------------------------------
    def _make_registry(self):
        from prometheus_client import CollectorRegistry, Counter

        reg = CollectorRegistry(auto_describe=False)
        load_gauges(reg, self.model_name, lambda: self.num_running, lambda: self.num_waiting)
        aborted = Counter("serve_hf_requests_aborted", "Requests aborted by a client disconnect.", registry=reg)
        tokens = Counter("serve_hf_generation_tokens", "Generated tokens.", registry=reg)
        return reg, aborted, tokens

    @property
    def num_running(self) -> int:
        return sum(1 for r in self._running if r.finish is None and not r.aborted)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> int:
        server = self

        class Handler(_Handler):
            srv = server

        self._httpd = _HTTPServer((self.host, self.port), Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self.port = self._httpd.server_address[1]
        self._sched = threading.Thread(target=self._scheduler, name="serve-hf-scheduler", daemon=True)
        self._sched.start()
        self._http_thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="serve-hf-http", daemon=True
        )
        self._http_thread.start()
        log.info("serve_hf_started", url=self.url, model=self.model_dir, max_model_len=self.max_model_len)
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._sched is not None:
            self._sched.join(timeout)
        for r in list(self._queue):
            r.finish = "abort"
            r.done.set()
        self._queue.clear()
        if self._http_thread is not None:
            self._http_thread.join(timeout)
        log.info("serve_hf_stopped", url=self.url, requests=self.stats["requests"])

    def __enter__(self) -> "HFServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- engine ----------------------------------------------------------------------
    def submit(self, req: _Req) -> None:
        torch = self.torch
        g = torch.Generator(device="cpu")
        g.manual_seed(req.seed if req.seed is not None else random.getrandbits(63))
        req.gen = g
        with self._cv:
            if self._stop:
                req.finish = "abort"
                req.done.set()
                return
            self._queue.append(req)
            self._cv.notify()

    def _scheduler(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                batch: list[_Req] = []
                while self._queue and len(batch) < self.max_batch_size:
                    r = self._queue.popleft()
                    if not r.aborted:
                        batch.append(r)
                self._running = batch
            if not batch:
                continue
            try:
                with self._model_lock:
                    self._run_batch(batch)
            except Exception as e:  # pragma: no cover - model failure
                log.error("serve_hf_batch_failed", error=f"{type(e).__name__}: {e}", batch=len(batch))
                for r in batch:
                    if r.finish is None:
                        r.finish = "error"
                        r.done.set()
            finally:
                self._running = []

    def _sample(self, logits_row: Any, req: _Req) -> tuple[int, float]:
        torch = self.torch
        if req.temperature <= 0.0:
            logp = torch.log_softmax(logits_row, dim=-1)
            tok = int(torch.argmax(logits_row))
            return tok, float(logp[tok])
        x = logits_row / req.temperature if req.temperature != 1.0 else logits_row
        if 0 < req.top_k < x.shape[-1]:
            kth = torch.topk(x, req.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if req.top_p < 1.0:
            sx, idx = torch.sort(x, descending=True)
            probs = torch.softmax(sx, dim=-1)
            cum = torch.cumsum(probs, dim=-1)
            remove = (cum - probs) > req.top_p
            remove[0] = False
            x = x.clone()
            x[idx[remove]] = float("-inf")
        logp = torch.log_softmax(x, dim=-1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=req.gen))
        return tok, float(logp[tok])

    def _finish_if_done(self, r: _Req, tok: int) -> None:
        n_total = len(r.prompt) + len(r.out_ids)
        if tok in r.stop_ids:
            r.finish, r.stop_reason = "stop", tok
        elif tok in r.eos_ids:
            r.finish = "stop"
        elif len(r.out_ids) >= r.max_tokens or n_total >= self.max_model_len:
            r.finish = "length"
        if r.stop_strs and r.finish in (None, "length"):  # as vLLM: a stop string wins over length
            hit = first_stop_string(self.tokenizer.decode(r.out_ids, skip_special_tokens=True), r.stop_strs)
            if hit is not None:
                r.finish, r.stop_reason = "stop", hit[1]

    def _run_batch(self, batch: list[_Req]) -> None:
        torch = self.torch
        B = len(batch)
        lens = [len(r.prompt) for r in batch]
        L = max(lens)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, L - lens[i] :] = torch.tensor(r.prompt, dtype=torch.long)
            attn[i, L - lens[i] :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        dev = self.device
        active = [True] * B
        cache = None
        cur_ids, cur_pos = input_ids, pos
        with torch.inference_mode():
            for step in itertools.count():
                kw = {self._cache_kw: cache} if cache is not None else {}
                if self._keep_kw is not None:
                    kw[self._keep_kw] = 1
                out = self.model(
                    input_ids=cur_ids.to(dev),
                    attention_mask=attn.to(dev),
                    position_ids=cur_pos.to(dev),
                    use_cache=True,
                    **kw,
                )
                cache = getattr(out, "cache", None)
                if cache is None:
                    cache = out.past_key_values
                logits = out.logits[:, -1, :].float().cpu()
                next_tok = [self.pad_id] * B
                for i, r in enumerate(batch):
                    if not active[i]:
                        continue
                    if r.aborted:
                        active[i] = False
                        continue
                    tok, lp = self._sample(logits[i], r)
                    r.out_ids.append(tok)
                    r.out_lps.append(lp)
                    next_tok[i] = tok
                    self._finish_if_done(r, tok)
                    if r.finish is not None:
                        active[i] = False
                        self._tokens_counter.inc(len(r.out_ids))
                        r.done.set()
                if not any(active) or self._stop:
                    break
                cur_ids = torch.tensor(next_tok, dtype=torch.long).view(B, 1)
                attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long)], dim=1)
                cur_pos = cur_pos[:, -1:] + 1
        for r in batch:
            if r.finish is None:
                r.finish = "abort"
                r.done.set()

    def reload(self, model_dir: str | Path) -> None:
        """Load new weights (same architecture and tokenizer) from ``model_dir`` and swap them in
        between two batches: a checkpoint swap without a process restart."""
        from transformers import AutoModelForCausalLM

        new = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=self.torch.float32, local_files_only=True
        ).to(self.device).eval()
        if int(new.config.vocab_size) != self.vocab_size:
            raise ValueError(f"vocab size {new.config.vocab_size} != {self.vocab_size}")
        with self._model_lock:
            self.model, self.model_dir = new, str(model_dir)
        self.stats["reloads"] += 1
        log.info("serve_hf_reloaded", model=self.model_dir)

    # -- request parsing -------------------------------------------------------------
    def make_request(self, api: str, body: dict) -> tuple[_Req | None, tuple[int, dict] | None]:
        try:
            if api == "vllm":
                prompt = body["prompt"]
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                    if len(prompt) != 1:
                        return None, (400, _err("only one prompt per request is supported"))
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
                sp = body
                mt = sp.get("max_tokens")
                seed = sp.get("seed")
            else:
                prompt = body.get("input_ids")
                if prompt is None:
                    text = body.get("text")
                    if not isinstance(text, str):
                        return None, (400, _err("input_ids or text is required"))
                    prompt = self.tokenizer.encode(text, add_special_tokens=False)
                sp = body.get("sampling_params") or {}
                mt = sp.get("max_new_tokens", 128)
                seed = sp.get("sampling_seed", sp.get("seed"))
            prompt = [int(x) for x in prompt]
            if not prompt:
                return None, (400, _err("empty prompt"))
            if any(t < 0 or t >= self.vocab_size for t in prompt):
                return None, (400, _err(f"token id out of range [0, {self.vocab_size})"))
            n = len(prompt)
            if api == "vllm":  # vLLM 0.32: clamp to the room left, 400 only past the context
                max_tokens, err = context_max_tokens(n, None if mt is None else int(mt), self.max_model_len, 16)
                if err is not None:
                    return None, (400, err)
            else:
                max_tokens = self.max_model_len - n if mt is None else int(mt)
                if n >= self.max_model_len or n + max_tokens > self.max_model_len:
                    return None, (400, _err(f"The input ({n} tokens) is longer than the model's context length "
                                            f"({self.max_model_len} tokens)."))
                if max_tokens < 1:
                    return None, (400, _err("max_new_tokens must be at least 1"))
            temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
            top_p = float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0)
            top_k = int(sp.get("top_k", -1) if sp.get("top_k") is not None else -1)
            if temperature < 0 or not 0 < top_p <= 1:
                return None, (400, _err("temperature must be >= 0 and top_p in (0, 1]"))
            stop_ids = [int(x) for x in (sp.get("stop_token_ids") or [])]
            stop = sp.get("stop") or []
            stop_strs = [stop] if isinstance(stop, str) else [str(x) for x in stop]
            eos = set() if sp.get("ignore_eos") else self.eos_ids
        except (KeyError, TypeError, ValueError) as e:
            return None, (400, _err(f"malformed request: {type(e).__name__}: {e}"))
        return _Req(api, prompt, max_tokens, temperature, top_p, top_k, seed, stop_ids, eos, stop_strs,
                    bool(sp.get("include_stop_str_in_output"))), None

    def render(self, req: _Req, body: dict) -> dict:
        ids, lps = req.out_ids, req.out_lps
        decode = lambda x: self.tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
        if isinstance(req.stop_reason, str):
            text = cut_at_stop_string(list(ids), decode, [req.stop_reason], req.include_stop)[1]
        else:
            text = reply_text(ids, decode, req.finish, req.stop_reason)
        if req.api == "vllm":
            return completion_body(rid=f"cmpl-{req.rid}", created=int(req.created),
                                   model=body.get("model") or self.model_name, prompt=req.prompt, ids=ids,
                                   logprobs=lps, finish=req.finish, stop_reason=req.stop_reason, text=text,
                                   req=body, token_str=lambda t: self.tokenizer.decode([t]))
        return sglang_generate_body(rid=body.get("rid") or req.rid, prompt=req.prompt, ids=ids, logprobs=lps,
                                    finish=req.finish, stop_reason=req.stop_reason, text=text, req=body,
                                    elapsed=time.time() - req.created)


def _err(message: str, etype: str = "BadRequestError", code: int = 400) -> dict:
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


class _HTTPServer(ThreadingHTTPServer):
    # The stdlib's listen backlog is 5: a trainer step opens dozens of connections at once, the
    # accept queue overflows, and the dropped handshakes come back only by TCP retransmission
    # (0.2, 0.4, 0.8 ... s), which on a busy box grew into 120 s job timeouts. uvicorn uses 2048.
    request_queue_size = 2048


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # idle keep-alive connections and stalled clients are dropped after this
    srv: HFServer  # set by HFServer.start
    server_version = "rolloutd-serve-hf"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        return  # keep stderr quiet; events go through structlog

    def _send(self, status: int, payload: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _send_json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj, separators=(",", ":")).encode())

    def do_GET(self) -> None:  # noqa: N802
        srv = self.srv
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/health_generate"):  # SGLang serves both; the router probes the second
            self._send(200, b"", "text/plain")
        elif path == "/v1/models":
            self._send_json(200, models_body(srv.model_name, srv.model_dir, srv.max_model_len))
        elif path == "/get_model_info":
            self._send_json(200, model_info_body(srv.model_dir))
        elif path == "/metrics":
            from prometheus_client import generate_latest

            self._send(200, generate_latest(srv._registry), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send_json(404, _err(f"no route {path}", "NotFoundError", 404))

    def do_POST(self) -> None:  # noqa: N802
        srv = self.srv
        path = self.path.split("?", 1)[0]
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n > 0 else b""
        if path == "/update_weights_from_disk":  # SGLang's name and body: {"model_path": DIR}
            try:
                body = json.loads(raw or b"{}")
                srv.reload(body["model_path"])
            except Exception as e:  # noqa: BLE001 - the old weights stay in place
                self._send_json(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
                return
            self._send_json(200, {"success": True, "message": f"loaded {srv.model_dir}"})
            return
        if path not in ("/v1/completions", "/generate"):
            self._send_json(404, _err(f"no route {path}", "NotFoundError", 404))
            return
        api = "vllm" if path == "/v1/completions" else "sglang"
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            self._send_json(400, _err(f"invalid JSON: {e}"))
            return
        srv.stats["requests"] += 1
        req, error = srv.make_request(api, body)
        if error is not None:
            self._send_json(error[0], error[1])
            return
        assert req is not None
        srv.submit(req)
        if api == "vllm" and body.get("stream"):
            self._stream(req, body)
            return
        sock = self.connection
        while not req.done.wait(0.02):
            if _peer_closed(sock):
                self._abort(req)
                return
        if req.finish == "error":
            self._send_json(500, _err("generation failed", "InternalServerError", 500))
            return
        srv.stats["completed"] += 1
        self._send_json(200, srv.render(req, body))


    def _abort(self, req: _Req) -> None:
        srv = self.srv
        req.aborted = True
        srv.stats["aborted"] += 1
        srv.stats["aborted_at_tokens"] += len(req.out_ids)  # how far it got: tests check it stopped early
        srv._aborted_counter.inc()
        log.info("serve_hf_request_aborted", rid=req.rid, generated=len(req.out_ids), reason="client_disconnected")
        self.close_connection = True

    def _stream(self, req: _Req, body: dict) -> None:
        """vLLM's ``stream: true`` reply (module doc): the tokens of each decode step as they come."""
        srv, tok = self.srv, self.srv.tokenizer
        so = body.get("stream_options")
        include_usage = isinstance(so, dict) and bool(so.get("include_usage"))
        rid, model = f"cmpl-{req.rid}", body.get("model") or srv.model_name

        def event(obj: Any) -> bytes:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode())
            data += b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        try:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            sent, offset = 0, 0
            while True:
                done = req.done.wait(0.02)
                if not done and _peer_closed(self.connection):
                    self._abort(req)
                    return
                if req.finish == "error":  # vLLM: an error event, then [DONE]
                    self.wfile.write(event(_err("generation failed", "InternalServerError", 500)) + event(b"[DONE]")
                                     + b"0\r\n\r\n")
                    return
                n = min(len(req.out_ids), len(req.out_lps))  # the scheduler appends both, one after the other
                if n > sent or done:
                    ids = req.out_ids[sent:n]
                    chunk, offset = stream_chunk(rid=rid, created=int(req.created), model=model, prompt=req.prompt,
                                                 ids=ids, logprobs=req.out_lps[sent:n],
                                                 text=tok.decode(ids, skip_special_tokens=True), first=sent == 0,
                                                 finish=req.finish if done else None,
                                                 stop_reason=req.stop_reason if done else None, req=body,
                                                 token_str=lambda t: tok.decode([t]), offset=offset)
                    self.wfile.write(event(chunk))
                    sent = n
                if done:
                    break
            tail = b""
            if include_usage:
                tail += event(stream_usage(rid=rid, created=int(req.created), model=model, n_prompt=len(req.prompt),
                                           n=sent))
            self.wfile.write(tail + event(b"[DONE]") + b"0\r\n\r\n")
            srv.stats["completed"] += 1
            srv.stats["streamed"] += 1
        except OSError:  # the client went away mid-stream: vLLM aborts the request
            if not req.done.is_set():
                self._abort(req)
            self.close_connection = True


def _peer_closed(sock: socket.socket) -> bool:
    try:
        r, _, _ = select.select([sock], [], [], 0)
        if not r:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rolloutd serve-hf",
        description="Serve a transformers causal LM with a vLLM-compatible /v1/completions (token ids in/out).",
    )
    p.add_argument("model_dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed as 'READY <port>')")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = p.parse_args(argv)
    server = HFServer(
        args.model_dir,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        device=args.device,
        threads=args.threads,
    )
    stop = threading.Event()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        print(f"READY {server.port}", flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
