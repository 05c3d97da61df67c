"""The auto-recovery budget: attempts per incident, not per deployment lifetime.

An *incident* starts when the deployment fails and ends when a recovery succeeds. Within one
incident at most ``limit`` automatic recoveries are tried (each attempt that fails leaves the
deployment ``failed`` for the next one); a success ends the incident and gives the whole budget
back, so the fourth separate rank loss of a long-lived deployment is recovered like the first.
``total`` counts every attempt ever made (the coordinator's ``auto_recoveries``).
"""

from __future__ import annotations

import threading

__all__ = ["RecoveryBudget"]


class RecoveryBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0  # attempts over the deployment's life
        self.incident = 0  # attempts since the last successful recovery
        self._lock = threading.Lock()

    def left(self) -> bool:
        """Whether another attempt may be made in the current incident."""
        return self.incident < self.limit

    def spend(self) -> bool:
        """Take one attempt; False (nothing taken) when the incident's budget is used up."""
        with self._lock:
            if self.incident >= self.limit:
                return False
            self.incident += 1
            self.total += 1
            return True

    def recovered(self) -> None:
        """A recovery succeeded: the incident is over and its budget is whole again."""
        with self._lock:
            self.incident = 0
