"""Tensor-parallel ranks: starting them, joining them into groups, watching them, ending them.

`specedge-server --tp N` is rank 0 itself (gRPC, scheduler, engine) and spawns
ranks 1..N-1 as child processes, which meet it through a TCPStore on a free
port. Under `torchrun` every rank is torchrun's, and the environment (RANK,
WORLD_SIZE, MASTER_ADDR, ...) says which this one is.

Two process groups:
- compute, the default group (NCCL on CUDA, gloo on CPU): the forward's
  all-reduces and the logits gather, with a timeout, since a collective inside
  a step that waits that long means a rank is stuck;
- control (gloo): rank 0's step messages (server/tp_runner.py). A worker waits
  on it for as long as the server idles, so its timeout is practically none.

Failure: a rank that dies breaks its sockets, so its peers' next collective
fails at once (gloo); rank 0 also watches its children's process sentinels,
and every spawned worker watches rank 0's. Rank 0 then stops serving (edges in
flight get UNAVAILABLE) and exits non-zero, and the workers exit with it. A
backstop timer hard-exits rank 0 if that clean shutdown stalls (an NCCL hang).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.multiprocessing
from torch import distributed as dist

from specedge.server.attention import numba_kernel as attention_kernel
from specedge.server.matmul import prepare
from specedge.server.parallel import GroupCollectives, load_shard
from specedge.server.runner import KVCache, ModelRunner
from specedge.server.tp_runner import Op, send_step, serve_steps

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=3650)  # a worker waits on rank 0 for as long as the server idles
HARD_EXIT_AFTER_S = {"starting": 5.0, "serving": 20.0}  # backstop after a failure, by phase
JOIN_TIMEOUT_S = 10.0  # for workers to exit after STOP


class RankFailure(RuntimeError):
    """The group broke: a rank died, or a collective failed or timed out. The message says which."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel ranks: processes, one GPU each on CUDA; 1 is the single-process server
    torchrun: bool = False  # the ranks were started by torchrun (env:// rendezvous): spawn none
    collective_timeout_s: float = 300.0  # a collective inside a step waiting this long means a rank is stuck
    exit_on_failure: bool = True  # hard-exit rank 0 if the clean shutdown after a rank's failure stalls

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective timeout must be > 0, got {self.collective_timeout_s}")

    @property
    def enabled(self) -> bool:
        """Ranks and process groups (even one rank under torchrun, which is how NCCL start-up is checked)."""
        return self.tp > 1 or self.torchrun


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join and load its shard; picklable, handed to each spawned worker."""

    rank: int
    world_size: int
    local_rank: int  # GPU index on CUDA
    model_dir: str  # HF safetensors directory (a GGUF was converted before any rank started)
    device_type: str  # "cpu" or "cuda"
    dtype: str  # torch dtype name, e.g. "float32"
    matmul: str  # the resolved matrix-product path: one of server/matmul.py's MATMUL_KINDS but "auto"
    attention: str  # the resolved attention path, "rows", "numba" or "flex" (server/attention.py)
    store_port: int | None  # rank 0's TCPStore on 127.0.0.1; None: torchrun's env:// rendezvous
    collective_timeout_s: float
    log_level: str = "INFO"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.device_type == "cuda" else torch.device("cpu")


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process, else None."""
    if not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world_size, int(os.environ.get("LOCAL_RANK", rank))


def _join(spec: RankSpec, store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join the compute group (the default group); returns the control group."""
    timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.local_rank)
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    if spec.store_port is None:  # torchrun's rendezvous, from the environment
        dist.init_process_group(
            backend, rank=spec.rank, world_size=spec.world_size, timeout=timeout, init_method="env://"
        )
    else:
        store = store or dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, rank=spec.rank, world_size=spec.world_size, timeout=timeout, store=store)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def _share_cpus(world_size: int) -> int:
    """CPU ranks on one machine split its cores instead of each using all; returns the previous thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    return before


class RankGroup:
    """Rank 0's handle on the group: the workers it spawned, the two process groups, and the group's health."""

    def __init__(self, spec: RankSpec, config: ParallelConfig, on_failure: Callable[[str], None]):
        self.spec = spec
        self.config = config
        self.failure: str | None = None  # why the group broke; set once
        self.serving = False
        self.control: dist.ProcessGroup | None = None
        self.collectives: GroupCollectives | None = None
        self._on_failure = on_failure
        self._workers: dict[int, multiprocessing.process.BaseProcess] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._threads_before = _share_cpus(spec.world_size) if spec.device_type == "cpu" else None

    @classmethod
    def launch(
        cls,
        config: ParallelConfig,
        model_dir: pathlib.Path,
        *,
        device_type: str,
        dtype: torch.dtype,
        matmul: str = "eager",
        attention: str = "rows",
        on_failure: Callable[[str], None] = lambda reason: None,
    ) -> RankGroup:
        """Start (or, under torchrun, meet) the other ranks and join the groups as rank 0."""
        world_size, local_rank, store = config.tp, 0, None
        if config.torchrun:
            ranks = torchrun_rank()
            if ranks is None:
                raise ValueError("--torchrun needs torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
            _, world_size, local_rank = ranks
        else:
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                world_size,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=config.collective_timeout_s),
            )
        spec = RankSpec(
            rank=0,
            world_size=world_size,
            local_rank=local_rank,
            model_dir=str(model_dir),
            device_type=device_type,
            dtype=str(dtype).removeprefix("torch."),
            matmul=matmul,
            attention=attention,
            store_port=None if store is None else store.port,
            collective_timeout_s=config.collective_timeout_s,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        )
        group = cls(spec, config, on_failure)
        if not config.torchrun:
            group._spawn_workers()
        try:
            group.control = _join(spec, store)
        except RuntimeError as exc:  # a rank never came (its error is above), or the rendezvous timed out
            reason = group.fail(exc)
            group.close()
            raise RankFailure(reason) from exc
        group.collectives = GroupCollectives()
        log.info("tensor parallel: %d ranks on %s joined (rank 0 is this process)", world_size, device_type)
        return group

    def _spawn_workers(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.spec.world_size):
            spec = dataclasses.replace(self.spec, rank=rank, local_rank=rank)
            worker = context.Process(target=worker_main, args=(spec,), name=f"specedge-tp-rank{rank}", daemon=True)
            worker.start()
            log.info("tensor-parallel rank %d: pid %d", rank, worker.pid)
            self._workers[rank] = worker
        threading.Thread(target=self._watch, name="specedge-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """Rank 0 learns of a dead worker at once, even while idle or stuck in a collective."""
        by_sentinel = {worker.sentinel: rank for rank, worker in self._workers.items()}
        ready = multiprocessing.connection.wait(list(by_sentinel))
        if not self._closing:
            rank = by_sentinel[cast(int, ready[0])]  # wait() returns some of what it was given: sentinels
            self._workers[rank].join(1.0)  # its fds close a moment before its exit code can be read
            self.fail(f"tensor-parallel rank {rank} exited with code {self._workers[rank].exitcode}")

    def start_serving(self, num_slots: int, max_len: int) -> None:
        """Every rank sizes its share of the KV slots alike; returns once every rank is ready."""
        if self.control is None:
            raise RankFailure(self.fail("the tensor-parallel group never joined"))
        try:
            send_step(self.control, Op.ALLOCATE_KV, [num_slots, max_len])
            dist.barrier(group=self.control)
        except RuntimeError as exc:
            raise RankFailure(self.fail(exc)) from exc
        self.serving = True

    def fail(self, cause: BaseException | str) -> str:
        """Record that the group broke (the first cause wins), tell the server, arm the backstop."""
        reason = cause if isinstance(cause, str) else self._explain(cause)
        with self._lock:
            first = self.failure is None
            if self.failure is None:
                self.failure = reason
        if first:
            log.error("%s: this server cannot serve any more", reason)
            self._on_failure(reason)
            if self.config.exit_on_failure:
                phase = "serving" if self.serving else "starting"
                threading.Thread(target=_hard_exit, args=(reason, phase), daemon=True).start()
        return self.failure

    def _explain(self, exc: BaseException) -> str:
        """A failed collective usually means a rank died: name it if it did (its exit code lands shortly)."""
        deadline = time.monotonic() + 2.0
        while self._workers and time.monotonic() < deadline:
            for rank, worker in self._workers.items():
                if worker.exitcode is not None:
                    return f"tensor-parallel rank {rank} exited with code {worker.exitcode}"
            time.sleep(0.05)
        return f"a tensor-parallel collective failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"

    def close(self) -> None:
        """Stop the workers (STOP when the group is healthy, else terminate), leave the groups."""
        self._closing = True
        if self.failure is None and self.control is not None:
            try:
                send_step(self.control, Op.STOP)
            except RuntimeError:
                log.warning("could not send STOP to the tensor-parallel ranks; terminating them")
        for worker in self._workers.values():
            worker.join(JOIN_TIMEOUT_S if self.failure is None else 0.5)
            if worker.is_alive():
                worker.terminate()
                worker.join(5)
            if worker.is_alive():
                worker.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)


def _hard_exit(reason: str, phase: str) -> None:
    """The backstop: in case this process has not ended by itself in time (blocked in a collective or a load)."""
    time.sleep(HARD_EXIT_AFTER_S[phase])
    outcome = "stopped serving (its clean shutdown stalled)" if phase == "serving" else "could not start"
    print(f"specedge-server: {reason}; {outcome}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


def worker_main(spec: RankSpec) -> None:
    """A worker rank's whole life (rank > 0): join, load its shard, run rank 0's steps until STOP."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank; rank 0 stops the others in order
    log_format = f"%(asctime)s %(levelname)s rank {spec.rank} %(name)s: %(message)s"
    logging.basicConfig(level=spec.log_level, format=log_format)
    parent = multiprocessing.parent_process()
    if parent is not None:  # spawned by rank 0 (torchrun watches its own ranks)
        threading.Thread(target=_exit_with, args=(parent, spec.rank), daemon=True).start()
    try:
        if spec.device_type == "cpu":
            _share_cpus(spec.world_size)
        control = _join(spec)
        dtype = getattr(torch, spec.dtype)
        model_dir = pathlib.Path(spec.model_dir)
        model = load_shard(model_dir, spec.rank, spec.world_size, GroupCollectives(), device=spec.device, dtype=dtype)
        prepare(model, spec.matmul)
        model.attention = spec.attention
        if spec.attention == "numba" and attention_kernel() is None:  # compiled (or loaded) now, not in a step
            raise RuntimeError("rank 0 chose numba attention, but its kernel does not compile on this rank")

        def make_runner(num_slots: int, max_len: int) -> ModelRunner:
            kv = KVCache(model, num_slots=num_slots, max_len=max_len, device=spec.device, dtype=dtype)
            return ModelRunner(model, kv)

        num_forwards = serve_steps(make_runner, control)
        log.info("stopping after %d forwards", num_forwards)
        dist.destroy_process_group()
    except Exception:
        log.exception("tensor-parallel rank %d failed; it exits, and rank 0 stops serving", spec.rank)
        logging.shutdown()
        os._exit(1)  # never linger in a broken group


def _exit_with(parent: multiprocessing.process.BaseProcess, rank: int) -> None:
    multiprocessing.connection.wait([parent.sentinel])
    log.error("rank 0 exited; rank %d exits too", rank)
    logging.shutdown()
    os._exit(1)
