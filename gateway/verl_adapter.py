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
``response_mask``           ``loss_mask`` (all 0 when ``status != "ok"``)
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

LLM serving stays veRL's: register the rollout replicas' HTTP addresses with the gateway
(:func:`register_verl_servers`) and re-register them with the new ``policy_version`` after
each weight sync. See docs/TRAINERS.md.

Configuration: the extra keys of the agent-loop YAML entry (``examples/verl/agent_loop.yaml``)::

    - name: rolloutd
      _target_: rolloutd.gateway.verl_adapter.RolloutdAgentLoop
      gateway: tcp://head:5550        # or ipc://...; default: $ROLLOUTD_GATEWAY, then the config file's
      handler: swe                    # default handler (a sample may name its own)
      deadline_s: 1800                # per-sample client deadline (placeholder "timeout" after it)
      task_timeout_s: 1800            # the job's budget inside the service
      resubmit_failed: 1              # re-run infrastructure failures (not bad rewards) this often

What each dataset row becomes (:meth:`RolloutdAgentLoop.build_task`): ``extra_info["rolloutd"]``
(or a top-level ``rolloutd`` field) may give ``{"handler", "instance", "instance_id",
"timeout_s"}`` outright; otherwise the instance is ``{"messages": raw_prompt,
"ground_truth": reward_model.ground_truth, "data_source", "extra_info"}``. Sampling
(``temperature``, ``top_p``, ``top_k``, ``max_tokens = rollout.response_length``) goes into
``instance["sampling"]``, which rolloutd's handlers read. Subclass and override
``build_task`` for anything else.

If veRL cannot be imported (it needs ray, hydra, tensordict, ...), this module still
imports: ``AgentLoopBase``/``AgentLoopOutput``/``AgentLoopMetrics`` are then stand-ins with
the fields and signatures of veRL 0.9.1 (``VERL_AVAILABLE`` is False and
``VERL_IMPORT_ERROR`` says why), so the conversion can be tested without veRL.
"""
from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from rolloutd.gateway.batch import BatchClient, token_arrays

try:  # the real interface
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

    VERL_AVAILABLE = True
    VERL_IMPORT_ERROR: str | None = None
except Exception as _e:  # noqa: BLE001 - ImportError, or a dependency failing at import time
    VERL_AVAILABLE = False
    VERL_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

    @dataclass
    class AgentLoopMetrics:  # stand-in: veRL 0.9.1 fields
        generate_sequences: float = 0.0
        tool_calls: float = 0.0
        compute_score: float = 0.0
        num_preempted: int = -1

    @dataclass
    class AgentLoopOutput:  # stand-in: veRL 0.9.1 fields (pydantic there, a dataclass here)
        prompt_ids: list[int]
        response_ids: list[int]
        response_mask: list[int]
        metrics: AgentLoopMetrics
        response_logprobs: Optional[list[float]] = None
        routed_experts: Optional[Any] = None
        multi_modal_data: Optional[dict[str, Any]] = None
        reward_score: Optional[float] = None
        num_turns: int = 0
        extra_fields: dict[str, Any] = field(default_factory=dict)
        mm_processor_kwargs: Optional[dict[str, Any]] = None
        mm_processor_output: Optional[list[dict[str, Any]]] = None

    class AgentLoopBase:  # stand-in: veRL 0.9.1 constructor and abstract run()
        def __init__(self, trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config,
                     hf_model_type: str | None = None, **kwargs):
            self.config = getattr(trainer_config, "config", trainer_config)
            self.rollout_config = _get(_get(self.config, "actor_rollout_ref"), "rollout")
            self.server_manager = server_manager
            self.tokenizer = tokenizer
            self.processor = processor
            self.dataset_cls = dataset_cls
            self.data_config = getattr(data_config, "config", data_config)

        async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
            raise NotImplementedError

    _registry: dict[str, dict] = {}

    def register(agent_name: str):
        def decorator(subclass):
            _registry[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}"}
            return subclass

        return decorator


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


@register(AGENT_NAME)
class RolloutdAgentLoop(AgentLoopBase):
    """veRL agent loop whose episodes run in rolloutd (see the module doc)."""

    def __init__(self, trainer_config=None, server_manager=None, tokenizer=None, processor=None, dataset_cls=None,
                 data_config=None, *, gateway: str | None = None, handler: str | None = None,
                 deadline_s: float | None = None, task_timeout_s: float | None = None, resubmit_failed: int = 0,
                 instance_key: str = "rolloutd", client=None, **kwargs):
        super().__init__(trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs)
        self.gateway = gateway
        self.handler = handler
        self.deadline_s = None if deadline_s is None else float(deadline_s)
        self.task_timeout_s = None if task_timeout_s is None else float(task_timeout_s)
        self.resubmit_failed = int(resubmit_failed)
        self.instance_key = instance_key
        self._client = client
        rc = getattr(self, "rollout_config", None)
        self.response_length = _get(rc, "response_length")
        self.prompt_length = _get(rc, "prompt_length")
        tok = tokenizer
        self.pad_token_id = getattr(tok, "pad_token_id", None)
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
            raise ValueError("RolloutdAgentLoop: no handler (set `handler:` in the agent loop config or "
                             f"extra_info[{self.instance_key!r}]['handler'])")
        instance = spec.get("instance")
        if instance is None:
            reward_model = _plain(kwargs.get("reward_model")) or {}
            rest = {k: v for k, v in extra_info.items() if k != self.instance_key} if isinstance(extra_info, dict) \
                else extra_info
            instance = {"messages": _plain(kwargs.get("raw_prompt")),
                        "ground_truth": reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                        "data_source": _plain(kwargs.get("data_source")), "extra_info": rest}
        instance = dict(_plain(instance))
        sampling = dict(instance.get("sampling") or {})
        for k in ("temperature", "top_p", "top_k"):
            if sampling_params.get(k) is not None:
                sampling.setdefault(k, _plain(sampling_params[k]))
        if self.response_length:
            sampling.setdefault("max_tokens", int(self.response_length))
        instance["sampling"] = sampling
        iid = spec.get("instance_id")
        if iid is None:
            idx = extra_info.get("index") if isinstance(extra_info, dict) else None
            idx = _plain(kwargs.get("index", idx))
            ds = _plain(kwargs.get("data_source"))
            iid = f"{ds}-{idx}" if idx is not None else uuid.uuid4().hex[:12]
        task = {"handler": handler, "instance": instance, "instance_id": str(iid), "n": 1}
        timeout = spec.get("timeout_s", self.task_timeout_s)
        if timeout is not None:
            task["timeout_s"] = float(timeout)
        return task

    # -- trajectory -> AgentLoopOutput -----------------------------------------------------
    def to_output(self, traj: dict) -> AgentLoopOutput:
        ok = traj.get("status") == "ok"
        prompt, resp, mask, lps = token_arrays(traj)
        if self.response_length:
            resp, mask, lps = resp[: self.response_length], mask[: self.response_length], lps[: self.response_length]
        if not ok:
            mask = np.zeros_like(mask)
        if len(resp) == 0:  # a job that failed before sampling: one masked pad token keeps shapes sane
            resp = np.asarray([self.pad_token_id], np.int64)
            mask = np.zeros(1, np.int64)
            lps = np.zeros(1, np.float32)
        lps = np.where(mask > 0, lps, 0.0).astype(np.float32)
        versions = [int(t["policy_version"]) for t in traj.get("turns") or () if t.get("policy_version") is not None]
        if not versions and traj.get("policy_version") is not None:
            versions = [int(traj["policy_version"])]
        m = traj.get("metrics") or {}
        timing = traj.get("timing") or {}
        extra = {
            "rolloutd_status": traj.get("status"),
            "rolloutd_ok": ok,
            "rolloutd_job_id": traj.get("job_id"),
            "rolloutd_error": traj.get("error"),
            "rolloutd_policy_version": traj.get("policy_version"),
            "rolloutd_eval_details": traj.get("eval_details") or {},
            "turn_scores": [],
            "tool_rewards": [],
            "reward_extra_info": {"rolloutd_ok": float(ok)},
        }
        if versions:
            extra["min_global_steps"] = min(versions)
            extra["max_global_steps"] = max(versions)
        metrics = AgentLoopMetrics(generate_sequences=float(m.get("llm_s", 0.0) or 0.0),
                                   tool_calls=float(m.get("tools_s", 0.0) or 0.0),
                                   compute_score=float(timing.get("eval", 0.0) or 0.0))
        return AgentLoopOutput(
            prompt_ids=prompt.tolist(),
            response_ids=resp.tolist(),
            response_mask=mask.tolist(),
            response_logprobs=lps.tolist(),
            reward_score=float(traj.get("reward", 0.0)) if ok else 0.0,
            num_turns=count_turns(traj),
            metrics=metrics,
            extra_fields=extra,
        )

    # -- the agent loop ----------------------------------------------------------------------
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        task = self.build_task(dict(sampling_params or {}), **kwargs)
        traj = await self.client.arollout(task, deadline_s=self.deadline_s)
        for _ in range(self.resubmit_failed):
            if traj.get("status") not in INFRA_STATUSES:
                break
            # An infrastructure failure says nothing about the policy: sample again rather than
            # hand veRL a masked-out row whose reward 0 would shift its GRPO group's baseline.
            traj = await self.client.arollout(task, deadline_s=self.deadline_s)
        return self.to_output(traj)
