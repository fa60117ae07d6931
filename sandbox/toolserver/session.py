"""What the bash and python sessions share: a restart, and a fresh start when the last one died."""
from __future__ import annotations

from typing import List


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
