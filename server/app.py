"""Assemble and run a server: model, KV cache, engine, gRPC."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc
import torch

from specedge.registry import resolve
from specedge.server.engine import Engine, EngineConfig
from specedge.server.loading import load_target
from specedge.server.runner import KVCache, ModelRunner
from specedge.server.service import SpecEdgeService
from specedge.v1 import specedge_pb2_grpc

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_MESSAGE_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str  # built-in name, path to a .gguf or HF directory, or hub id
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    max_context: int | None = None  # default: min(4096, the model's max positions)
    engine: EngineConfig = EngineConfig()

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(_DTYPES)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no CUDA device is available")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


class SpecEdgeServer:
    """Owns the engine and the gRPC server; `await start()`, then `await stop()`."""

    def __init__(self, config: ServerConfig):
        self.config = config
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        started = time.monotonic()
        target = load_target(resolve(config.model), device=device, dtype=dtype)
        max_context = min(config.max_context or 4096, target.model.args.max_position_embeddings)
        engine_config = dataclasses.replace(config.engine, max_context=max_context)
        kv = KVCache(target.model, num_slots=engine_config.max_sessions, max_len=max_context, device=device, dtype=dtype)
        log.info(
            "loaded %s on %s (%s) in %.1f s; KV: %d slots x %d tokens (%.2f GiB)",
            target.name, device, dtype, time.monotonic() - started, kv.num_slots, kv.max_len,
            kv.bytes_per_token * kv.num_slots * kv.max_len / 2**30,
        )  # fmt: skip
        self.engine = Engine(ModelRunner(target.model, kv), target, engine_config)
        self._grpc: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> str:
        await self.engine.start()
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self._grpc = grpc.aio.server(options=options)
        specedge_pb2_grpc.add_SpecEdgeServicer_to_server(SpecEdgeService(self.engine), self._grpc)
        self.port = self._grpc.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port} (in use?)")
        await self._grpc.start()
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace: float = 5.0) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace)
        await self.engine.stop()
