"""The control channel between the ranks of a tensor-parallel group (engine/tensor_parallel.py):
[kind, value] headers broadcast from rank 0 over a gloo group. Between generations rank 0 sends
commands (one JSON message each: the session call every rank runs); inside a generation it sends
each token after the reply's consumer took it (GO), END where forced ids ran out, or STOP where
the reply ended otherwise. A rank that receives what it does not expect raises OutOfStep.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

GO, END, STOP, COMMAND = 1, 2, 3, 4


class Interrupted(Exception):
    """A following rank was told that the leader's reply stopped."""


class OutOfStep(RuntimeError):
    """A rank received a message it did not expect: the ranks no longer run the same calls."""


class Link:
    """One rank's end of the control channel: [kind, value] headers over a gloo group."""

    def __init__(self, group, follower: bool):
        self.group, self.follower = group, follower
        self._head = torch.zeros(2, dtype=torch.int64)

    def _put(self, kind: int, value: int) -> None:
        self._head[0], self._head[1] = kind, value
        dist.broadcast(self._head, 0, group=self.group)

    def _get(self) -> tuple[int, int]:
        dist.broadcast(self._head, 0, group=self.group)
        kind, value = self._head.tolist()
        return kind, value

    # tokens (inside a generation)
    def send(self, token: int | None) -> None:
        self._put(END, 0) if token is None else self._put(GO, token)

    def stop(self) -> None:
        self._put(STOP, 0)

    def receive(self) -> int | None:
        kind, value = self._get()
        if kind == STOP:
            raise Interrupted
        if kind not in (GO, END):
            raise OutOfStep("expected a token from rank 0, got a command")
        return value if kind == GO else None

    def agree_min(self, *values: int) -> tuple[int, ...]:
        """Every rank's smallest of each value (all ranks call it at the same point): settings
        that must be equal on all ranks, such as checkpoint budgets sized from each rank's free
        memory (a rank with one slot more would evict, and so reuse, differently)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return tuple(t.tolist())

    # commands (between generations)
    def command(self, op: str, **args) -> None:
        data = json.dumps(dict(args, op=op)).encode("utf-8")
        self._put(COMMAND, len(data))
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def next_command(self) -> dict:
        kind, n = self._get()
        if kind != COMMAND:
            raise OutOfStep("expected a command from rank 0, got a token")
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return json.loads(bytes(buf.numpy()).decode("utf-8"))
