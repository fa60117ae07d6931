"""The tool server's kill of an agent's tree leaves the agent no turn to react.

An agent past its wall budget must not run another line: its shell, seeing its foreground
child die, would otherwise go on (``echo never``; a ``trap``) and exit 0, and the result would
read as a clean exit. CI met it as ``exit_code 0`` on a timed-out harness job.
"""
import os
import subprocess
import time

from rolloutd.sandbox.toolserver.agentproc import kill_agent


def test_a_killed_agent_runs_no_line_after_its_children_die(tmp_path):
    marker = tmp_path / "ran-on"
    # On one CPU the woken shell preempts the killer between its children's SIGKILL and its
    # own: without the shell stopped first, every round of this loop failed.
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        for _ in range(30):
            p = subprocess.Popen(["bash", "-c", f"sleep 1000 & sleep 1000; echo never > {marker}"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            time.sleep(0.02)  # both sleeps started
            kill_agent(p.pid)
            assert p.wait(timeout=30) == -9
            assert not marker.exists()
    finally:
        os.sched_setaffinity(0, cpus)
