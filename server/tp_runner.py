"""Rank 0's runner under tensor parallelism, and the loop every other rank runs.

Rank 0 is a Runner (server/runner.py: `forward`, `move_kv`) like ModelRunner, so the engine does
not know about ranks. Each call is first broadcast to the other ranks as one
small int64 message (the requests themselves, not the batch layout: every rank
builds the same layout from them), then every rank runs it on its shard. The
forward's all-reduces keep the ranks in step, and rank 0 alone gets the
gathered logits.

    message: header [op, n], then n int64s of payload
    FORWARD       [num_requests, per request: slot, num_cached, num_tokens, all_logits, is_tree,
                   tokens..., parents of tokens 1.. (is_tree only)]
    MOVE_KV       [num_moves, per move: slot, n, src..., dst...]
    ALLOCATE_KV   [num_slots, max_len]       (once, at start)
    STOP          []

    e.g. one chain of 2 tokens in slot 3 after 10 cached: FORWARD [1, 3, 10, 2, 1, 0, 17, 42]

Any failure inside a step is fatal to the whole group: once one rank has
broadcast or entered a collective that another never reaches, they can no
longer agree on what comes next. Rank 0 then answers UNAVAILABLE and the
server stops (see server/distributed.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import distributed as dist

from specedge.server import errors
from specedge.server.runner import ForwardRequest, KVMove, ModelRunner


class Op(enum.IntEnum):
    FORWARD = 1
    MOVE_KV = 2
    ALLOCATE_KV = 3
    STOP = 4


class RankLost(errors.Unavailable):
    """A tensor-parallel rank died or stopped answering: this server can serve nothing more."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; this server is shutting down, retry on another")


def encode_requests(requests: Sequence[ForwardRequest]) -> list[int]:
    values = [len(requests)]
    for r in requests:
        is_tree = r.tree_parents is not None
        values += [r.slot, r.num_cached, len(r.token_ids), int(r.all_logits), int(is_tree), *r.token_ids]
        values += r.tree_parents or ()
    return values


def decode_requests(values: Sequence[int]) -> list[ForwardRequest]:
    stream = iter(values)
    requests = []
    for _ in range(next(stream)):
        slot, num_cached, num_tokens, all_logits, is_tree = (next(stream) for _ in range(5))
        tokens = tuple(next(stream) for _ in range(num_tokens))
        parents = tuple(next(stream) for _ in range(num_tokens - 1)) if is_tree else None
        requests.append(ForwardRequest(slot, num_cached, tokens, tree_parents=parents, all_logits=bool(all_logits)))
    if next(stream, None) is not None:
        raise ValueError("FORWARD message longer than its requests")
    return requests


def encode_moves(moves: Sequence[KVMove]) -> list[int]:
    values = [len(moves)]
    for move in moves:
        values += [move.slot, len(move.src), *move.src, *move.dst]
    return values


def decode_moves(values: Sequence[int]) -> list[KVMove]:
    stream = iter(values)
    moves = []
    for _ in range(next(stream)):
        slot, n = next(stream), next(stream)
        src = tuple(next(stream) for _ in range(n))
        moves.append(KVMove(slot, src, tuple(next(stream) for _ in range(n))))
    if next(stream, None) is not None:
        raise ValueError("MOVE_KV message longer than its moves")
    return moves


def send_step(group: dist.ProcessGroup, op: Op, payload: Sequence[int] = ()) -> None:
    """Rank 0: broadcast one message to every rank of `group`."""
    dist.broadcast(torch.tensor([int(op), len(payload)], dtype=torch.long), src=0, group=group)
    if payload:
        dist.broadcast(torch.tensor(payload, dtype=torch.long), src=0, group=group)


def receive_step(group: dist.ProcessGroup) -> tuple[Op, list[int]]:
    """Any other rank: wait (as long as the server idles) for rank 0's next message."""
    header = torch.empty(2, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    op, length = Op(int(header[0])), int(header[1])
    payload = torch.empty(length, dtype=torch.long)
    if length:
        dist.broadcast(payload, src=0, group=group)
    return op, payload.tolist()


def serve_steps(make_runner: Callable[[int, int], ModelRunner], group: dist.ProcessGroup) -> int:
    """A worker rank's life after loading: allocate the KV, then run rank 0's steps until STOP.

    `make_runner(num_slots, max_len)` builds this rank's runner once rank 0 has sized the KV.
    Returns the number of forwards run.
    """
    runner: ModelRunner | None = None
    num_forwards = 0
    for op, payload in _messages(group):
        if op is Op.ALLOCATE_KV:
            runner = make_runner(*payload)
            dist.barrier(group=group)  # tells rank 0 this rank is ready
        elif op is Op.FORWARD:
            assert runner is not None, "rank 0 allocates the KV before the first step"
            runner.forward(decode_requests(payload))
            num_forwards += 1
        elif op is Op.MOVE_KV:
            assert runner is not None, "rank 0 allocates the KV before the first step"
            runner.move_kv(decode_moves(payload))
    return num_forwards


def _messages(group: dist.ProcessGroup) -> Iterator[tuple[Op, list[int]]]:
    while True:
        op, payload = receive_step(group)
        if op is Op.STOP:
            return
        yield op, payload


class RankGroupHandle(Protocol):
    """What the runner needs from rank 0's RankGroup (server/distributed.py)."""

    control: dist.ProcessGroup | None  # None until the group has joined
    failure: str | None

    def fail(self, cause: BaseException | str) -> str:
        """Record that the group broke (idempotent); returns the reason for the edges."""


class TensorParallelRunner:
    """The Runner on rank 0: each call runs on every rank, in the same order."""

    def __init__(self, local: ModelRunner, group: RankGroupHandle):
        self.local = local  # rank 0's shard and its KV
        self.group = group
        self.model, self.kv, self.device = local.model, local.kv, local.device

    def forward_packed(self, requests: Sequence[ForwardRequest]) -> torch.Tensor | None:
        return self._on_every_rank(Op.FORWARD, encode_requests(requests), lambda: self.local.forward_packed(requests))

    def forward(self, requests: Sequence[ForwardRequest]) -> list[torch.Tensor]:
        return self._on_every_rank(Op.FORWARD, encode_requests(requests), lambda: self.local.forward(requests))

    def move_kv(self, moves: Sequence[KVMove]) -> None:
        self._on_every_rank(Op.MOVE_KV, encode_moves(moves), lambda: self.local.move_kv(moves))

    def _on_every_rank(self, op: Op, payload: list[int], run_here: Callable):
        if self.group.failure is not None:
            raise RankLost(self.group.failure)
        if self.group.control is None:
            raise RankLost(self.group.fail("the tensor-parallel group never joined"))
        try:
            send_step(self.group.control, op, payload)
            return run_here()
        except Exception as exc:  # the ranks are out of step now, whatever failed
            raise RankLost(self.group.fail(exc)) from exc
