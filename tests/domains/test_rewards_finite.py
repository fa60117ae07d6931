"""Issue 35 item 3 and 6 through the base class, for handlers that are not ours: every reward that
leaves a handler is finite and within +-REWARD_BOUND (a handler's NaN fails its job: the grader is
broken), and an AgentFault scores the job 0 with the reason instead of failing it. Run through
run_local, which drives the phases and exception hooks as the daemons do."""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from rolloutd.handlers.base import REWARD_BOUND, AgentFault, AgentHandler, InvalidReward, check_reward
from rolloutd.handlers.tasks import run_local


class Scripted(AgentHandler):
    """eval does what the instance says: set_reward(value), write the reward directly, raise."""

    async def eval(self, ctx):
        how = ctx.instance["how"]
        if how == "set":
            ctx.set_reward(ctx.instance["value"], note="x")
        elif how == "direct":
            ctx.trajectory["reward"] = ctx.instance["value"]
        elif how == "fault":
            raise AgentFault("the agent made its workspace unreadable")
        elif how == "bug":
            raise KeyError("grader bug")


class OwnFinal(Scripted):
    def final_result(self, ctx):
        traj = dict(super().final_result(ctx))
        traj["reward"] = float("nan")
        return traj


class FaultInRun(AgentHandler):
    def run(self, ctx):  # a plain def: run in a thread, guarded the same way
        raise AgentFault("the agent filled its disk before grading")

    async def eval(self, ctx):
        ctx.set_reward(1.0)  # must not run after the fault


def job(handler, **instance):
    return asyncio.run(run_local(handler, instance))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e308, -1e7, 10 ** 400, "1", None])
@pytest.mark.parametrize("how", ["set", "direct"])
def test_a_handlers_invalid_reward_fails_its_job(how, value):
    r = job(Scripted(), how=how, value=value)
    assert r["status"] == "failed" and r["failed_phase"] == "eval", r
    assert r["error"]["type"] == "InvalidReward" and r["reward"] == 0.0, r["error"]


@pytest.mark.parametrize("value", [0, 1, 0.5, -1.0, REWARD_BOUND, -REWARD_BOUND, True, np.float32(0.25), np.int64(1)])
def test_valid_rewards_pass_as_floats(value):
    r = job(Scripted(), how="set", value=value)
    assert r["status"] == "ok" and r["reward"] == float(value) and type(r["reward"]) is float, r


def test_an_overridden_final_result_is_checked_too():
    r = job(OwnFinal(), how="set", value=1.0)
    assert r["status"] == "failed" and r["error"]["type"] == "InvalidReward" and not math.isnan(r["reward"]), r


def test_an_agent_fault_in_eval_is_reward_zero_with_the_reason():
    r = job(Scripted(), how="fault")
    assert r["status"] == "ok" and r["reward"] == 0.0 and r["error"] is None, r
    assert r["eval_details"]["reason"] == "the agent made its workspace unreadable"
    assert r["eval_details"]["agent_fault"] == {"phase": "eval", "type": "AgentFault"}


def test_an_agent_fault_in_run_skips_eval_and_scores_zero():
    r = job(FaultInRun())
    assert r["status"] == "ok" and r["reward"] == 0.0, r
    assert r["eval_details"]["agent_fault"]["phase"] == "run" and "filled its disk" in r["eval_details"]["reason"]


def test_a_grader_bug_still_fails_the_job():
    r = job(Scripted(), how="bug")
    assert r["status"] == "failed" and r["error"]["type"] == "KeyError", r


def test_check_reward_messages():
    with pytest.raises(InvalidReward, match="not finite"):
        check_reward(float("nan"))
    with pytest.raises(InvalidReward, match="outside"):
        check_reward(2e6)


def test_a_synthetic_reward_past_the_bound_fails_its_job():
    from rolloutd.handlers.synthetic import SyntheticHandler

    r = asyncio.run(run_local(SyntheticHandler(), {"reward": 1e308}))
    assert r["status"] == "failed" and r["error"]["type"] == "InvalidReward", r
    assert asyncio.run(run_local(SyntheticHandler(), {"reward": 0.75}))["reward"] == 0.75
