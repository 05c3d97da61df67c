"""A rank's commands, in sequence order (see :mod:`elastic.core.protocol`).

Inside a group, the ranks agree at each step boundary on the highest seq every rank has received
(``received_seq``, the end of the gap-free run) and execute every command up to it, in order.
Outside a group (broken, or standing by) commands are taken as they arrive.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from elastic.core import protocol as p

__all__ = ["CommandInbox"]


class CommandInbox:
    def __init__(self, source: Any):
        self.source = source  # the queue the coordinator's commands arrive on
        self.received_seq = 0  # the end of the gap-free run of command seqs received (see take)
        self.executed_seq = 0
        self.pending: dict[int, p.Command] = {}

    def take(self, command: p.Command) -> None:
        """File a received command. ``received_seq`` is the end of the gap-free run received:
        every command up to it is here (or done), so agreeing on it never names a missing one."""
        if command.seq <= self.executed_seq or command.seq in self.pending:
            return  # a duplicate delivery
        self.pending[command.seq] = command
        while self.received_seq + 1 in self.pending:
            self.received_seq += 1

    def poll(self, block_until: int | None = None, timeout: float = 0.0) -> None:
        """Move commands from the queue to ``pending``; with ``block_until``, wait (at most
        ``timeout``) until every command up to that seq is here. Never skips a number."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = block_until is not None and self.received_seq < block_until
            try:
                command = self.source.get(block=waiting,
                                          timeout=max(0.0, deadline - time.monotonic()) if waiting else None)
            except queue.Empty:
                if block_until is not None and self.received_seq < block_until:
                    raise TimeoutError(f"command {self.received_seq + 1} (of up to {block_until}, agreed by the "
                                       f"group) did not arrive within {timeout:.1f}s") from None
                return
            self.take(command)

    def wait(self, timeout: float) -> bool:
        """Block (at most ``timeout``) until a command not executed yet is here; True when one is.
        An idle group's ranks sleep here: an admission or any other command wakes them at once."""
        if self.received_seq > self.executed_seq or self.pending:
            return True
        try:
            command = self.source.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return False
        self.take(command)
        return True

    def pop_next(self) -> p.Command:
        """The next command in sequence (it must be here: see :meth:`poll`), marked executed."""
        command = self.pending.pop(self.executed_seq + 1)
        self.executed_seq = command.seq
        return command

    def next_arrival(self, wait_s: float) -> p.Command | None:
        """Outside a group: the next command not acted on yet (those received before the group
        broke first), marked executed; None when none arrives within ``wait_s``."""
        while True:
            if self.pending:
                command = self.pending.pop(min(self.pending))
            else:
                try:
                    command = self.source.get(timeout=wait_s)
                except queue.Empty:
                    return None
            if command.seq > self.executed_seq:
                self.received_seq = max(self.received_seq, command.seq)
                self.executed_seq = command.seq
                return command
            # already acted on before the group broke
