"""veRL agent-loop adapter: veRL's rollout step runs each sample through rolloutd.

veRL (>= 0.5, checked against 0.9.1, ``verl/experimental/agent_loop/agent_loop.py``) runs one
``AgentLoopBase`` object per sample: ``AgentLoopWorker`` instantiates the class registered
under the sample's ``agent_name`` (``hydra.utils.instantiate`` with ``trainer_config``,
``server_manager``, ``tokenizer``, ``processor``, ``dataset_cls``, ``data_config`` and the
extra keys of its entry in ``actor_rollout_ref.rollout.agent.agent_loop_config_path``), then
awaits ``run(sampling_params, **dataset_fields)`` and pads the returned ``AgentLoopOutput``
(prompt left, response right, to ``rollout.prompt_length`` / ``rollout.response_length``).

:class:`RolloutdAgentLoop` is such a class. Its ``run`` submits the sample to the rolloutd
gateway as one job (the handler runs the whole multi-turn episode: sandbox, tools, LLM
calls, reward) and turns the trajectory into veRL's output fields:

==========================  =========================================================
``AgentLoopOutput`` field   from the rolloutd trajectory
==========================  =========================================================
``prompt_ids``              ``prompt_ids``
``response_ids``            ``response_ids`` (sampled + observation tokens), cut to
                            ``rollout.response_length``
``response_mask``           ``loss_mask`` (all 0 when ``status != "ok"``, and for a cut
                            response under ``truncated_rows: mask``)
``response_logprobs``       ``logprobs`` (0 on observation tokens)
``reward_score``            ``reward`` (0.0 when ``status != "ok"``; veRL then puts it on
                            the last response token as ``rm_scores`` and skips its own
                            reward function)
``num_turns``               1 (the prompt) + assistant turns + observation segments
``metrics``                 ``generate_sequences`` = ``metrics.llm_s``, ``tool_calls`` =
                            ``metrics.tools_s``, ``compute_score`` = ``timing.eval``
``extra_fields``            ``rolloutd_status``, ``rolloutd_ok``, ``rolloutd_job_id``,
                            ``rolloutd_error``, ``rolloutd_policy_version``,
                            ``rolloutd_eval_details``, ``min_global_steps`` /
                            ``max_global_steps`` (the turns' policy versions: veRL's own
                            staleness fields), ``turn_scores``, ``tool_rewards``,
                            ``reward_extra_info`` = ``{"rolloutd_ok": 0/1}``
==========================  =========================================================

A trajectory with segments (``trajectory["segments"]``, the bring-your-own-agent endpoint: one
episode whose context was rebuilt, so it is several token sequences) becomes one
``AgentLoopOutput`` per segment on veRL's V1 path (``segments: all``, the default there:
``AgentLoopWorkerTQ`` stores each under ``{uid}_{session}_{i}``, same GRPO group, the final reward
copied to every segment), and only the last segment on the legacy path, whose worker takes one
output per sample (``segments: last``, its default).

LLM serving stays veRL's: register the rollout replicas' HTTP addresses with the gateway
(:func:`register_verl_servers`) and re-register them with the new ``policy_version`` after
each weight sync. See docs/TRAINERS.md.

Configuration: the extra keys of the agent-loop YAML entry (``examples/verl/agent_loop.yaml``)::

    - name: rolloutd
      _target_: rolloutd.gateway.verl_adapter.RolloutdAgentLoop
      gateway: tcp://head:5550        # or ipc://...; default: $ROLLOUTD_GATEWAY, then the config file's
      handler: dialogue               # handler for rows without their own spec (a chat handler)
      deadline_s: 1800                # per-sample client deadline (placeholder "timeout" after it)
      task_timeout_s: 1800            # the job's budget inside the service
      resubmit_failed: 1              # re-run infrastructure failures (not bad rewards) this often
      tokenizer_path: null            # what the handler renders chat rows with; default model.path
      segments: null                  # all | last; default: all on V1, last on legacy
      failed_rows: mask               # mask | raise (V1: the group is marked failure and evicted)
      truncated_rows: mask            # mask | keep: a response cut to response_length (see below)

What each dataset row becomes (:meth:`RolloutdAgentLoop.build_task`): ``extra_info["rolloutd"]``
(or a top-level ``rolloutd`` field) may give ``{"handler", "instance", "instance_id",
"timeout_s", "sampling"}`` outright; otherwise the row is an ordinary veRL chat row and must go to
a chat handler (:data:`CHAT_HANDLERS`): the instance is ``{"messages": raw_prompt, "expect":
reward_model.ground_truth, "ground_truth", "data_source", "extra_info", "tokenizer"}``. A row that
cannot be run is refused with a ValueError naming what it lacks (the first training step fails
at once, before any sample is wasted). Sampling: veRL's ``temperature``/``top_p``/``top_k`` (its
greedy validation settings included) win over the instance's own ``sampling`` values; only the
row's spec-level ``extra_info.rolloutd.sampling`` overrides veRL (``sampling: false`` there leaves
the instance untouched, as for the built-in handlers that take no ``sampling``:
:data:`NO_SAMPLING_HANDLERS`); ``max_tokens`` is capped at
``rollout.response_length``.

Prompt length: a prompt longer than ``rollout.prompt_length`` is left-truncated by veRL's own
``AgentLoopBase._cap_text_prompt_length`` (what its single-turn and tool agent loops do to text
prompts; veRL rejects only multimodal prompts, which rolloutd does not produce), and the row is
flagged ``extra_fields["rolloutd_prompt_truncated"]``.

Response length: a response longer than ``rollout.response_length`` (a multi-turn episode's
sampled and observation tokens together) is cut on the right and flagged
``extra_fields["rolloutd_response_truncated"]``. Its ``reward_score`` is the episode's reward,
earned by turns the trainer no longer sees; veRL puts it on the last kept token. With
``truncated_rows: mask`` (the default) the row's ``response_mask`` is all 0, so its tokens give no
gradient while its reward still counts in its GRPO group's mean (DAPO's overlong filtering);
``keep`` trains on the kept tokens with that reward.

``min_global_steps`` / ``max_global_steps`` are always ints (veRL V1 casts them with
``np.array(..., dtype=int)``): the turns' policy versions, else the trajectory's, else the row's
``global_steps`` (V1 passes it), else the newest version this process has seen, else 0.

veRL 0.9.1 is required (``pip install 'rolloutd[trainers]' && pip install --no-deps verl==0.9.1``);
importing this module without it raises ImportError saying so.
"""
from __future__ import annotations

import os
import threading
import uuid
from typing import Any

import numpy as np

from rolloutd.gateway.batch import BatchClient, reward_of, segments_of, token_arrays, token_policy_versions, trainable

try:  # the real interface: no stand-ins, the adapter is only ever tested against veRL itself
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
except Exception as _e:  # noqa: BLE001 - ImportError, or a dependency failing at import time
    raise ImportError(f"rolloutd.gateway.verl_adapter needs veRL 0.9.1's agent loop ({type(_e).__name__}: {_e}); "
                      "install it with: pip install 'rolloutd[trainers]' && pip install --no-deps verl==0.9.1") from _e

AGENT_NAME = "rolloutd"
INFRA_STATUSES = ("failed", "timeout", "cancelled")

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _get(obj, key, default=None):
    """``obj.key`` / ``obj[key]`` for DictConfig, dict, dataclass or None."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    try:
        return obj.get(key, default)  # DictConfig
    except (AttributeError, TypeError):
        return getattr(obj, key, default)


def _plain(x):
    """numpy / OmegaConf values from veRL's non-tensor batch as msgpack-able Python values."""
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            return [_plain(v) for v in x.tolist()]
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if type(x).__name__ in ("DictConfig", "ListConfig"):
        from omegaconf import OmegaConf

        return _plain(OmegaConf.to_container(x, resolve=True))
    return x


def shared_client(address: str | None = None, **kw):
    """One :class:`~rolloutd.gateway.batch.BatchClient` per gateway address and process: veRL makes a new
    agent-loop object per sample, and they all share it (and its submit coalescing)."""
    address = address or os.environ.get("ROLLOUTD_GATEWAY")
    if address is None:
        from rolloutd.bus.config import Config

        address = Config.load(None).endpoints.gateway
    with _clients_lock:
        c = _clients.get(address)
        if c is None or c._closed:
            c = _clients[address] = BatchClient(address, **kw)
        return c


def close_shared_clients():
    with _clients_lock:
        for c in _clients.values():
            c.close()
        _clients.clear()


def register_verl_servers(client, addresses, policy_version: int, api: str = "vllm", **kw) -> list[dict]:
    """Checkpoint swap for veRL's rollout replicas: clear the gateway's backends and register
    ``addresses`` (``"host:port"`` from ``replica.server_address``, or URLs) at ``policy_version``
    (veRL's ``global_steps``). Call it after every ``update_weights``."""
    urls = [a if "://" in a else f"http://{a}" for a in addresses]
    if hasattr(client, "swap_backends"):
        return client.swap_backends(urls, policy_version, api=api, **kw)
    client.clear_backends()
    return [client.add_backend(u, api=api, policy_version=policy_version, **kw) for u in urls]


def count_turns(traj: dict) -> int:
    """veRL's ``num_turns``: chat messages, the prompt counting as one (single turn = 2)."""
    turns = traj.get("turns") or []
    n = 1 + len(turns)
    prev_end = None
    for t in turns:
        span = t.get("span") or (0, 0)
        if prev_end is not None and span[0] > prev_end:
            n += 1  # an observation segment between two assistant turns
        prev_end = span[1]
    if turns and prev_end is not None and prev_end < len(traj.get("response_ids", ())):
        n += 1  # trailing observation tokens
    return n


class RowRefused(ValueError):
    """A dataset row the configured handler cannot run (says what the row lacks)."""


class SampleFailed(RuntimeError):
    """``failed_rows: raise``: an infrastructure failure veRL should treat as a failed session."""


# Handlers that run an ordinary chat row (``raw_prompt`` messages + ``reward_model``), and the
# instance fields each needs from it. The harness handler joins this list once it ships.
CHAT_HANDLERS = {"dialogue": ("messages",)}

# Built-in handlers whose instances take no `sampling` map (they refuse unknown keys): the
# synthetic ones, and harness (its agent samples through the endpoint; limits.max_tokens caps it).
NO_SAMPLING_HANDLERS = frozenset({"synthetic", "synthetic_llm", "harness"})

_newest_version = [None]  # the newest policy version any adapter in this process saw (fallback steps)


def _as_int_steps(*candidates) -> int:
    for c in candidates:
        if c is not None:
            try:
                return int(c)
            except (TypeError, ValueError):
                continue
    return 0


@register(AGENT_NAME)
class RolloutdAgentLoop(AgentLoopBase):
    """veRL agent loop whose episodes run in rolloutd (see the module doc)."""

    def __init__(self, trainer_config=None, server_manager=None, tokenizer=None, processor=None, dataset_cls=None,
                 data_config=None, *, gateway: str | None = None, handler: str | None = None,
                 deadline_s: float | None = None, task_timeout_s: float | None = None, resubmit_failed: int = 0,
                 instance_key: str = "rolloutd", tokenizer_path: str | None = None, segments: str | None = None,
                 failed_rows: str = "mask", truncated_rows: str = "mask", client=None, **kwargs):
        super().__init__(trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs)
        self.gateway = gateway
        self.handler = handler
        self.deadline_s = None if deadline_s is None else float(deadline_s)
        self.task_timeout_s = None if task_timeout_s is None else float(task_timeout_s)
        self.resubmit_failed = int(resubmit_failed)
        self.instance_key = instance_key
        self._client = client
        rc = self.rollout_config
        self.response_length = _get(rc, "response_length")
        self.prompt_length = _get(rc, "prompt_length")
        self.use_v1 = bool(_get(_get(self.config, "trainer"), "use_v1", False))
        if segments is None:
            segments = "all" if self.use_v1 else "last"
        if segments not in ("all", "last"):
            raise ValueError(f"RolloutdAgentLoop: segments must be 'all' or 'last', not {segments!r}")
        if segments == "all" and not self.use_v1:
            raise ValueError("RolloutdAgentLoop: segments: all needs veRL's V1 path (trainer.use_v1: true); the legacy "
                             "AgentLoopWorker takes one output per sample")
        self.segments = segments
        if failed_rows not in ("mask", "raise"):
            raise ValueError(f"RolloutdAgentLoop: failed_rows must be 'mask' or 'raise', not {failed_rows!r}")
        self.failed_rows = failed_rows
        if truncated_rows not in ("mask", "keep"):
            raise ValueError(f"RolloutdAgentLoop: truncated_rows must be 'mask' or 'keep', not {truncated_rows!r}")
        self.truncated_rows = truncated_rows
        self.tokenizer_path = tokenizer_path or _get(_get(_get(self.config, "actor_rollout_ref"), "model"), "path")
        self.pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if self.pad_token_id is None:
            self.pad_token_id = 0

    @property
    def client(self):
        if self._client is None:
            self._client = shared_client(self.gateway)
        return self._client

    # -- dataset row -> rolloutd task ------------------------------------------------------
    def build_task(self, sampling_params: dict[str, Any], **kwargs) -> dict:
        extra_info = _plain(kwargs.get("extra_info")) or {}
        spec = extra_info.get(self.instance_key) if isinstance(extra_info, dict) else None
        if spec is None:
            spec = _plain(kwargs.get(self.instance_key))
        spec = dict(spec or {})
        handler = spec.get("handler") or self.handler
        if not handler:
            raise RowRefused("RolloutdAgentLoop: no handler (set `handler:` in the agent loop config or "
                             f"extra_info[{self.instance_key!r}]['handler'])")
        instance = spec.get("instance")
        if instance is None:
            instance = self.chat_instance(handler, kwargs, extra_info)
        instance = dict(_plain(instance))
        if spec.get("sampling") is not False and handler not in NO_SAMPLING_HANDLERS:
            # veRL's sampling wins over the instance's values (its greedy validation must stay
            # greedy); only the row's spec-level `sampling` says otherwise.
            sampling = dict(instance.get("sampling") or {})
            for k in ("temperature", "top_p", "top_k"):
                if sampling_params.get(k) is not None:
                    sampling[k] = _plain(sampling_params[k])
            sampling.update(_plain(spec.get("sampling") or {}))
            if self.response_length:
                cap = int(self.response_length)
                sampling["max_tokens"] = min(int(sampling.get("max_tokens", cap)), cap)
            instance["sampling"] = sampling
        iid = spec.get("instance_id")
        if iid is None:
            uid = _plain(kwargs.get("uid"))  # V1: veRL's own id of the prompt (its GRPO group)
            idx = extra_info.get("index") if isinstance(extra_info, dict) else None
            idx = _plain(kwargs.get("index", idx))
            ds = _plain(kwargs.get("data_source"))
            iid = uid if uid is not None else f"{ds}-{idx}" if idx is not None else uuid.uuid4().hex[:12]
        task = {"handler": handler, "instance": instance, "instance_id": str(iid), "n": 1}
        timeout = spec.get("timeout_s", self.task_timeout_s)
        if timeout is not None:
            task["timeout_s"] = float(timeout)
        return task

    def chat_instance(self, handler: str, row: dict, extra_info) -> dict:
        """The instance of an ordinary veRL chat row, or RowRefused saying what is missing."""
        if handler not in CHAT_HANDLERS:
            raise RowRefused(
                f"RolloutdAgentLoop: handler {handler!r} cannot run an ordinary veRL chat row (raw_prompt + "
                f"reward_model): the row lacks extra_info[{self.instance_key!r}]['instance'] (the {handler} "
                f"instance). Give rows that spec, or use a chat handler: {', '.join(sorted(CHAT_HANDLERS))}")
        messages = _plain(row.get("raw_prompt"))
        lacks = []
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                      for m in messages):
            lacks.append("raw_prompt (a non-empty list of chat messages with role/content)")
        reward_model = _plain(row.get("reward_model")) or {}
        ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        if ground_truth is None:
            lacks.append("reward_model.ground_truth (the dialogue handler's reward: the last answer contains it)")
        if not (self.tokenizer_path or os.environ.get("ROLLOUTD_TOKENIZER")):
            lacks.append("a tokenizer (actor_rollout_ref.model.path or the adapter's tokenizer_path)")
        if lacks:
            raise RowRefused(f"RolloutdAgentLoop: handler {handler!r} cannot run this row: it lacks "
                             + "; ".join(lacks))
        rest = {k: v for k, v in extra_info.items() if k != self.instance_key} if isinstance(extra_info, dict) \
            else extra_info
        inst = {"messages": messages, "expect": str(ground_truth), "ground_truth": ground_truth,
                "data_source": _plain(row.get("data_source")), "extra_info": rest}
        if self.tokenizer_path:
            inst["tokenizer"] = str(self.tokenizer_path)
        return inst

    # -- trajectory -> AgentLoopOutput -----------------------------------------------------
    def to_output(self, traj: dict, *, global_steps=None) -> AgentLoopOutput:
        """The trajectory (its last segment, if it has several) as one AgentLoopOutput."""
        return self.to_outputs(traj, global_steps=global_steps)[-1]

    def to_outputs(self, traj: dict, *, global_steps=None) -> list[AgentLoopOutput]:
        """One AgentLoopOutput per segment (``segments: all``), or of the last one."""
        segs = segments_of(traj)
        if self.segments == "last":
            segs = segs[-1:]
        return [self._segment_output(traj, seg, global_steps) for seg in segs]

    def _segment_output(self, traj: dict, seg: dict, global_steps) -> AgentLoopOutput:
        ok = trainable(traj)  # status ok and a finite reward: never a NaN into veRL
        prompt, resp, mask, lps = token_arrays(seg)
        truncated = False
        if self.prompt_length and len(prompt) > int(self.prompt_length):
            prompt = np.asarray(self._cap_text_prompt_length(prompt.tolist()), np.int64)  # veRL's own rule
            truncated = True
        cut = bool(self.response_length) and len(resp) > int(self.response_length)
        if cut:
            n = int(self.response_length)
            resp, mask, lps = resp[:n], mask[:n], lps[:n]
        if not ok or (cut and self.truncated_rows == "mask"):
            # A cut response's reward was earned (or not) by turns the trainer never sees: no gradient
            # from its tokens (DAPO's overlong filtering); its reward still counts in the group's mean.
            mask = np.zeros_like(mask)
        if len(prompt) == 0:  # failed before the prompt was rendered: veRL's tensors need a token
            prompt = np.asarray([self.pad_token_id], np.int64)
        if len(resp) == 0:  # a job that failed before sampling: one masked pad token keeps shapes sane
            resp = np.asarray([self.pad_token_id], np.int64)
            mask = np.zeros(1, np.int64)
            lps = np.zeros(1, np.float32)
        lps = np.where(mask > 0, lps, 0.0).astype(np.float32)
        tokver = token_policy_versions(seg)[:len(resp)]  # per response token; -1: observation or pad
        tokver = np.concatenate([tokver, np.full(len(resp) - len(tokver), -1, np.int64)])
        versions = [int(t["policy_version"]) for t in seg.get("turns") or () if t.get("policy_version") is not None]
        if not versions and traj.get("policy_version") is not None:
            versions = [int(traj["policy_version"])]
        if versions:
            _newest_version[0] = max(versions + ([_newest_version[0]] if _newest_version[0] is not None else []))
        else:  # no turn ran: the row's own step, so veRL's int cast and staleness metrics stay sane
            versions = [_as_int_steps(global_steps, _newest_version[0])]
        m = traj.get("metrics") or {}
        timing = traj.get("timing") or {}
        extra = {
            "rolloutd_status": traj.get("status"),
            "rolloutd_ok": ok,
            "rolloutd_job_id": traj.get("job_id"),
            "rolloutd_error": traj.get("error"),
            "rolloutd_policy_version": traj.get("policy_version"),
            "rolloutd_eval_details": traj.get("eval_details") or {},
            "rolloutd_prompt_truncated": truncated,
            "rolloutd_response_truncated": cut,
            "rolloutd_segment": int(seg.get("index", 0)),
            "turn_scores": [],
            "tool_rewards": [],
            "reward_extra_info": {"rolloutd_ok": float(ok)},
            "rolloutd_token_policy_versions": tokver.tolist(),  # a swap under stale_policy=continue mixes them
            "min_global_steps": min(versions),
            "max_global_steps": max(versions),
        }
        metrics = AgentLoopMetrics(generate_sequences=float(m.get("llm_s", 0.0) or 0.0),
                                   tool_calls=float(m.get("tools_s", 0.0) or 0.0),
                                   compute_score=float(timing.get("eval", 0.0) or 0.0))
        return AgentLoopOutput(
            prompt_ids=prompt.tolist(),
            response_ids=resp.tolist(),
            response_mask=mask.tolist(),
            response_logprobs=lps.tolist(),
            reward_score=reward_of(traj),
            num_turns=count_turns(seg),
            metrics=metrics,
            extra_fields=extra,
        )

    # -- the agent loop ----------------------------------------------------------------------
    async def run(self, sampling_params: dict[str, Any], **kwargs):
        task = self.build_task(dict(sampling_params or {}), **kwargs)
        traj = await self.client.arollout(task, deadline_s=self.deadline_s)
        for _ in range(self.resubmit_failed):
            if traj.get("status") not in INFRA_STATUSES:
                break
            # An infrastructure failure says nothing about the policy: sample again rather than
            # hand veRL a masked-out row whose reward 0 would shift its GRPO group's baseline.
            traj = await self.client.arollout(task, deadline_s=self.deadline_s)
        if self.failed_rows == "raise" and traj.get("status") in INFRA_STATUSES:
            err = traj.get("error") or {}
            raise SampleFailed(f"rolloutd job {traj.get('job_id')} {traj.get('status')}: "
                               f"{err.get('type', '')}: {err.get('message', '')}")
        outs = self.to_outputs(traj, global_steps=_plain(kwargs.get("global_steps")))
        return outs if self.segments == "all" and len(outs) > 1 else outs[-1]
