"""What the bash and python sessions share: a restart, and a fresh start when the last one died."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional


class Session:
    """Subclasses provide ``proc``, ``start()``, ``alive()``, ``kill()`` and ``restarts``."""

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
