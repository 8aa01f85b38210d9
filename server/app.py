"""Assemble and run a server: model, KV cache, engine, gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specedge.registry import resolve
from specedge.scheduler import slots_within_budget
from specedge.server.attention import ATTENTION_KINDS, resolve_attention
from specedge.server.auth import Authenticator
from specedge.server.cuda_graphs import GraphedRunner, graphs_unavailable
from specedge.server.decoding import LenientDecoding
from specedge.server.distributed import ParallelConfig, RankGroup
from specedge.server.engine import Engine, EngineConfig
from specedge.server.limits import DEFAULT_MAX_ATTACH_PER_IDENTITY, AttachLimiter, RateLimitConfig, RoundRateLimiter
from specedge.server.loading import load_target, weights_dir
from specedge.server.matmul import MATMUL_KINDS, resolve_matmul
from specedge.server.metrics import start_metrics_server, stop_metrics_server
from specedge.server.parallel import check_splittable
from specedge.server.runner import KVCache, ModelRunner, Runner
from specedge.server.server_draft import ServerDrafter
from specedge.server.service import SpecEdgeService
from specedge.server.stats import ServerStats
from specedge.server.tp_runner import TensorParallelRunner
from specedge.server.transport import TransportConfig
from specedge.tokens import IncompatibleTokenizer, check_compatible
from specedge.v1 import specedge_pb2, specedge_pb2_grpc

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from specedge.fleet.announcer import Announcer, AnnouncerConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SERVICE_NAME = specedge_pb2.DESCRIPTOR.services_by_name["SpecEdge"].full_name  # "specedge.v1.SpecEdge"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str  # built-in name, path to a .gguf or HF directory, or hub id
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    # How the target's matrix products run (server/matmul.py): auto (on CPU numba, else oneDNN; on CUDA fused),
    # eager, fused, numba, onednn.
    matmul: str = "auto"
    # How rows attend to their KV slots (server/attention.py): auto (flex on CUDA; on a CPU numba for float32, else
    # rows), rows, numba, flex.
    attention: str = "auto"
    # Replay one CUDA graph per token-count bucket for steps of up to 512 tokens (server/cuda_graphs.py),
    # where the device, attention and parallelism allow it; False: every step runs eagerly.
    cuda_graphs: bool = True
    max_context: int | None = None  # default: min(4096, the model's max positions)
    engine: EngineConfig = EngineConfig()
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None = off, 0 picks a free port
    metrics_host: str | None = None  # default: same as host
    # Label verified tokens and cut draft nodes by identity in /metrics (token names, or without tokens
    # connection addresses: sensitive, and one series per connection), only when the operator asks.
    metrics_per_identity: bool = False
    # KV memory budget in GiB; slots beyond it are not created. None: 90% of free
    # GPU memory after the weights, or half the available RAM on CPU.
    kv_cache_gb: float | None = None
    # A draft model on the server itself, for server-side speculative decoding
    # (the baseline; edges bring their own drafts).
    draft_model: str | None = None
    # Announce this server on a fleet broker (MQTT) and obey drain commands; None: no control plane.
    fleet: AnnouncerConfig | None = None
    # Tensor parallelism: the target split across ranks (server/distributed.py); the
    # server draft model, if any, stays whole on rank 0.
    parallel: ParallelConfig = ParallelConfig()
    transport: TransportConfig = TransportConfig()  # TLS, message size, connection limits
    auth_tokens: str | None = None  # token file (server/auth.py); None: no tokens, sessions bound to connections
    rate_limit: RateLimitConfig = RateLimitConfig()  # rounds per second per identity
    # Attach streams open at once per identity (without tokens, per connection): each is a call in
    # progress for as long as its connection lives, so uncapped, one identity could take them all.
    max_attach_per_identity: int = DEFAULT_MAX_ATTACH_PER_IDENTITY

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(_DTYPES)}")
        if self.matmul not in MATMUL_KINDS:
            raise ValueError(f"unknown matmul path {self.matmul!r}; choose {', '.join(MATMUL_KINDS)}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention path {self.attention!r}; choose {', '.join(ATTENTION_KINDS)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in 0..65535, got {self.metrics_port}")
        if self.max_attach_per_identity < 1:
            raise ValueError(f"max Attach streams per identity must be >= 1, got {self.max_attach_per_identity}")
        self.transport.check_exposure(self.host)

    def torch_device(self) -> torch.device:
        """Rank 0's device (under tensor parallelism rank i runs on GPU i)."""
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(auto if self.device == "auto" else self.device)
        if self.parallel.enabled and device.type == "cuda":
            if device.index is not None:
                raise ValueError(f"--tp places rank i on GPU i; give --device cuda, not {self.device}")
            if not self.parallel.torchrun and self.parallel.tp > torch.cuda.device_count():
                raise ValueError(
                    f"--tp {self.parallel.tp} needs {self.parallel.tp} GPUs (one per rank), "
                    f"but {torch.cuda.device_count()} are present"
                )
            return torch.device("cuda", 0)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no CUDA device is available")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


class SpecEdgeServer:
    """Owns the engine, the gRPC server and the stats; `await start()`, then `await stop()`."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.authenticator = Authenticator(config.auth_tokens)  # a bad token file fails before the model loads
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        if device.type == "cuda" and dtype != torch.float32:
            log.info(
                "%s on CUDA: the GPU's kernels round differently for steps of different shapes, so an answer can "
                "change with the batch it rides in; --dtype float32 keeps speculative output equal to target-only "
                "decoding (README, Lossless)",
                str(dtype).removeprefix("torch."),
            )
        started = time.monotonic()
        resolved = resolve(config.model)
        self.failure: str | None = None  # set when a tensor-parallel rank fails; the server must stop
        self._failed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ranks: RankGroup | None = None
        if config.parallel.enabled:
            model_dir = weights_dir(resolved)  # a GGUF is converted here, once, before any rank starts
            check_splittable(model_dir, config.parallel.tp)
            self.ranks = RankGroup.launch(
                config.parallel,
                model_dir,
                device_type=device.type,
                dtype=dtype,
                matmul=resolve_matmul(config.matmul, device, dtype),
                attention=resolve_attention(config.attention, device, dtype),
                on_failure=self._on_rank_failure,
            )
        try:
            self._build(config, resolved, device, dtype, started)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        self._grpc: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics: WSGIServer | None = None  # the metrics HTTP server, when metrics_port is set
        self.announcer: Announcer | None = None  # the fleet control plane, when config.fleet is set
        self.service: SpecEdgeService | None = None  # the gRPC handlers and their limiters, once started
        self.port: int | None = None
        self.metrics_port: int | None = None

    def _build(self, config: ServerConfig, resolved, device: torch.device, dtype: torch.dtype, started: float) -> None:
        """Model(s), KV slots within the budget, runner, engine."""
        collectives = self.ranks.collectives if self.ranks is not None else None
        target = load_target(
            resolved,
            device=device,
            dtype=dtype,
            collectives=collectives,
            matmul=config.matmul,
            attention=config.attention,
        )
        max_context = min(config.max_context or 4096, target.model.args.max_position_embeddings)
        draft = None
        if config.draft_model is not None:
            draft = load_target(
                resolve(config.draft_model),
                device=device,
                dtype=dtype,
                matmul=config.matmul,
                attention=config.attention,
            )
            try:
                check_compatible(draft.fingerprint, target.fingerprint)
            except IncompatibleTokenizer as exc:
                raise ValueError(f"--draft-model {config.draft_model} cannot draft for {config.model}: {exc}") from None
        models = [target] if draft is None else [target, draft]
        bytes_per_slot = sum(KVCache.bytes_per_token_for(m.model, dtype) for m in models) * max_context
        if self.ranks is not None and device.type == "cpu":
            bytes_per_slot *= self.ranks.spec.world_size  # CPU ranks share this machine's memory
        budget = _kv_budget_bytes(config.kv_cache_gb, device)
        no_graphs = graphs_unavailable(device, target.model.attention, self.ranks is not None)
        use_graphs = config.cuda_graphs and no_graphs is None
        # With graphs, one slot more than the engine hands out (within the budget): the scratch slot that
        # padding tokens write to.
        num_slots = (
            slots_within_budget(
                requested=config.engine.max_sessions + use_graphs, bytes_per_slot=bytes_per_slot, budget_bytes=budget
            )
            - use_graphs
        )
        if num_slots < 1:  # the budget holds a single slot: a session's, not the scratch slot's
            use_graphs, no_graphs, num_slots = False, "the KV budget holds one slot, kept for a session", 1
        if budget is not None and num_slots < config.engine.max_sessions:  # no budget: every slot asked for
            log.warning(
                "KV budget of %.2f GiB holds %d of the %d sessions asked for; the rest are refused with "
                "RESOURCE_EXHAUSTED",
                budget / 2**30,
                num_slots,
                config.engine.max_sessions,
            )
        engine_config = dataclasses.replace(config.engine, max_context=max_context, max_sessions=num_slots)
        largest_request = engine_config.request_limits(target.model.args.vocab_size).largest_request_bytes()
        if largest_request > config.transport.max_message_bytes:
            raise ValueError(
                f"a request within the limits may take {largest_request} bytes, more than the message size limit "
                f"of {config.transport.max_message_bytes}; raise --max-message-bytes or lower the token limits"
            )
        kv = KVCache(target.model, num_slots=num_slots + use_graphs, max_len=max_context, device=device, dtype=dtype)
        log.info(
            "loaded %s on %s (%s, %s matrix products, %s attention) in %.1f s; KV: %d slots x %d tokens (%.2f GiB)",
            target.name,
            device,
            dtype,
            target.matmul,
            target.model.attention,
            time.monotonic() - started,
            num_slots,
            kv.max_len,
            bytes_per_slot * kv.num_slots / 2**30,
        )
        self.stats = ServerStats(per_identity=config.metrics_per_identity)  # the engine reports; metrics.py exports
        self.stats.set_sessions(active=0, slots_used=0, slots_free=num_slots)
        server_drafter = None
        if draft is not None:
            draft_kv = KVCache(draft.model, num_slots=num_slots, max_len=max_context, device=device, dtype=dtype)
            server_drafter = ServerDrafter(ModelRunner(draft.model, draft_kv))
        local = ModelRunner(target.model, kv)
        runner: Runner = local
        if self.ranks is not None:
            self.ranks.start_serving(num_slots, max_context)
            runner = TensorParallelRunner(local, self.ranks)
        if use_graphs:
            graphed = GraphedRunner(local)
            log.info(
                "CUDA graphs: %d buckets (%s tokens) captured in %.1f s; larger steps run eagerly",
                len(graphed.buckets),
                ", ".join(map(str, graphed.buckets)),
                graphed.capture(),
            )
            runner = graphed
        elif device.type == "cuda":
            log.info("CUDA graphs off: %s", "--no-cuda-graphs" if no_graphs is None else no_graphs)
        self.engine = Engine(runner, target, engine_config, stats=self.stats, server_drafter=server_drafter)
        self.engine.calibrate()  # the step budget's first cost curve, logged

    def _on_rank_failure(self, reason: str) -> None:
        """Any thread: a tensor-parallel rank failed, so this server must stop (see `wait_failed`)."""
        self.failure = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._failed.set)

    async def wait_failed(self) -> str:
        """Returns (the reason) once the server can no longer serve."""
        await self._failed.wait()
        assert self.failure is not None, "set before the event"
        return self.failure

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        if self.failure is not None:
            self._failed.set()
        await self.engine.start()
        transport = self.config.transport
        self._grpc = grpc.aio.server(
            options=transport.grpc_options(),
            interceptors=[LenientDecoding(f"/{SERVICE_NAME}/")],
            maximum_concurrent_rpcs=transport.max_concurrent_rpcs,
        )
        self.service = SpecEdgeService(
            self.engine,
            authenticator=self.authenticator,
            rate_limiter=RoundRateLimiter(self.config.rate_limit),
            attach_limiter=AttachLimiter(self.config.max_attach_per_identity),
            transport=transport,
        )
        specedge_pb2_grpc.add_SpecEdgeServicer_to_server(self.service, self._grpc)
        # Load balancers and `grpc_health_probe` ask "" (the whole server) or the service by name.
        self._health = health.aio.HealthServicer()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        try:
            self.port = transport.bind(self._grpc, f"{self.config.host}:{self.config.port}")
        except RuntimeError:  # grpcio raises "Failed to bind", where older releases returned port 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port} (in use?)")
        if self.config.metrics_port is not None:
            metrics_host = self.config.metrics_host or self.config.host
            self._metrics, self.metrics_port = start_metrics_server(self.stats, metrics_host, self.config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", metrics_host, self.metrics_port)
        await self._grpc.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        address = f"{self.config.host}:{self.port}"
        if self.config.fleet is not None:  # announced only once it serves
            from specedge.server.fleet_link import start_announcer

            self.announcer = await start_announcer(self.config.fleet, self.engine, address)
        return address

    async def stop(self, grace: float = 5.0) -> None:
        if self.announcer is not None:  # first: edges stop choosing us while we wind down
            await self.announcer.stop()
            self.announcer = None
        if self._health is not None:
            # Tell health checkers first, so balancers drain us during the grace period.
            await self._health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        await self.engine.stop()
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.close)
        if self._metrics is not None:
            await asyncio.to_thread(stop_metrics_server, self._metrics)
            self._metrics = None


def _kv_budget_bytes(kv_cache_gb: float | None, device: torch.device) -> int | None:
    """The KV budget: explicit, else a share of what the device has free now."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * 2**30)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    try:  # Linux: the kernel's estimate of memory available without swapping
        with open("/proc/meminfo") as meminfo:
            available_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
        return available_kib * 1024 // 2
    except (OSError, StopIteration, ValueError):
        return None
