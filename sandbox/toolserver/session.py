"""What the bash and python sessions share: a restart, a fresh start when the last one died, and
restart notes that reach a caller even when the call that restarted was never answered."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from .output import DEFAULT_MAX_OUTPUT


class Session:
    """Subclasses provide ``proc``, ``start()``, ``alive()`` and ``kill()``.

    A restart loses cwd, variables and jobs, so the agent must hear of it. The call that
    restarted may never be answered (its client gave up): its restart notes then go into the
    next reply. ``take_unreported`` opens a call, ``defer`` is called (under the tool's lock)
    when the reply of that call will not be delivered.
    """

    def __init__(self, env: Dict[str, str], cwd: str, limits: Optional[Dict[str, Optional[float]]] = None,
                 max_output: int = DEFAULT_MAX_OUTPUT, interrupt_grace: float = 1.0) -> None:
        self.env = dict(env)
        self.cwd = cwd
        self.limits = limits or {}
        self.max_output = max_output
        self.interrupt_grace = interrupt_grace
        self.restarts = 0
        self.restart_notes: List[str] = []   # restarts the current call's reply reports
        self.unreported: List[str] = []      # restarts no delivered reply has reported yet

    def take_unreported(self) -> List[str]:
        notes, self.unreported = self.unreported, []
        self.restart_notes = list(notes)
        return list(notes)

    def defer(self) -> None:
        self.unreported, self.restart_notes = self.restart_notes, []

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def revive(self, died_note: str) -> List[str]:
        """Start afresh if the process is gone; the note tells the caller (and the model) why."""
        notes: List[str] = []
        if not self.alive():
            if self.proc is not None:
                notes.append(died_note)
                self.restart_notes.append(died_note)
            self.kill()
            self.start()
        return notes


def call_result(text: str, truncated: bool, notes: List[str], exit_code: Optional[int], t0: float,
                timed_out: bool, cancelled: bool) -> Dict[str, Any]:
    """The reply to one call: its output, then the session's notes (restarts, deaths) after it."""
    if notes:
        text = text + ("\n" if text and not text.endswith("\n") else "") + "\n".join(notes)
    result = {
        "output": text,
        "exit_code": exit_code,
        "duration": time.monotonic() - t0,
        "timed_out": timed_out,
        "error": None,
        "truncated": truncated,
    }
    if cancelled:
        result["cancelled"] = True
    return result
