"""`specedge-server`: serve a target model for edges to verify against.

specedge-server --model NAME [options]   serve
specedge-server make-token NAME          print a fresh token, then its line for the --auth-tokens file
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from specedge.fleet.broker import FleetError, add_broker_options
from specedge.scheduler import BatcherConfig
from specedge.server.distributed import ParallelConfig, RankFailure, RankSpec, torchrun_rank, worker_main
from specedge.server.engine import EngineConfig
from specedge.server.limits import DEFAULT_MAX_ATTACH_PER_IDENTITY, RateLimitConfig
from specedge.server.matmul import MATMUL_KINDS
from specedge.server.transport import TransportConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="specedge-server",
        description=__doc__.split(":", 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Securing a server: see SECURITY.md.",
    )
    parser.add_argument("--model", required=True, help="built-in name, .gguf file, HF model directory or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, bfloat16 on CUDA. bfloat16 on a CPU with AVX512_BF16 halves the weight "
        "stream, but changes the target's numerics (its answers are then bfloat16's answers); on CUDA they also "
        "change with the batch, and float32 keeps speculative output equal to target-only decoding",
    )
    parser.add_argument(
        "--matmul",
        default="auto",
        choices=list(MATMUL_KINDS),
        help="matrix products: auto (on CPU, numba for float32; for bfloat16 numba where its panels run, else "
        "onednn-numba where it runs, else onednn; on CUDA, fused), eager (torch's plain path), fused (the "
        "same, q/k/v and gate/up stacked into one product each), numba (weights streamed at memory speed for small "
        "batches, oneDNN's GEMM for prefill), onednn (weights packed for oneDNN; float32 or bfloat16), "
        "onednn-numba (bfloat16 packed for oneDNN, small batches read by numba's kernel: CPUs with AVX512_BF16 "
        "and no AMX)",
    )
    parser.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "rows", "numba", "flex"],
        help="attention: auto (one FlexAttention call per step on CUDA; numba on a CPU for float32, else rows), "
        "rows (one scaled-dot-product call per row), numba (short rows in one compiled call per layer, long rows "
        "as rows), flex",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, run every step eagerly instead of replaying one captured graph per token-count bucket",
    )
    parser.add_argument("--max-sessions", type=int, default=8, help="KV slots, i.e. concurrent sessions")
    parser.add_argument("--max-context", type=int, default=None, help="tokens per session (default 4096)")
    parser.add_argument("--max-draft-tokens", type=int, default=64, help="draft nodes accepted per round")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a draft model on the server, for server-side speculative decoding (the baseline)",
    )
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="KV memory budget; sessions beyond it get RESOURCE_EXHAUSTED (default: 90%% of free GPU memory, "
        "or half the available RAM)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks: the target split across N processes (rank i on GPU i with --device cuda; "
        "gloo on CPU). Default 1, or torchrun's WORLD_SIZE under torchrun",
    )
    parser.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle session is closed")
    shares = parser.add_argument_group("fair shares of a step (see SECURITY.md)")
    shares.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="tokens one step carries, shared max-min across identities (default: the measured cost curve's knee)",
    )
    shares.add_argument(
        "--no-fair-shares",
        dest="fair_shares",
        action="store_false",
        help="take rounds in arrival order with no step budget (one identity can then slow every other)",
    )
    shares.add_argument(
        "--no-gather",
        dest="gather",
        action="store_false",
        help="start each step the moment work is queued, rather than holding it (at most the step's fixed cost "
        "less the queued rows' turnaround) for rounds due back from edges",
    )
    security = parser.add_argument_group("security (see SECURITY.md)")
    security.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    security.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    security.add_argument(
        "--tls-client-ca", default=None, help="PEM CA bundle: require edge certificates it signed (mTLS)"
    )
    security.add_argument("--auth-tokens", default=None, help="token file, lines NAME:SHA256HEX (see make-token)")
    security.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext on a non-loopback --host (only behind a trusted network or TLS proxy)",
    )
    limits = parser.add_argument_group("limits (all reported to edges in the handshake)")
    limits.add_argument("--max-prompt-tokens", type=int, default=None, help="default: --max-context minus one")
    limits.add_argument("--max-draft-prob-tokens", type=int, default=256, help="entries per draft distribution")
    limits.add_argument("--max-sessions-per-identity", type=int, default=None, help="default: --max-sessions")
    limits.add_argument("--max-rounds-per-second", type=float, default=None, help="per identity (default: no limit)")
    limits.add_argument("--round-burst", type=int, default=32, help="rounds an identity may send at once")
    limits.add_argument("--max-message-bytes", type=int, default=1 << 20, help="largest request or reply")
    limits.add_argument("--max-concurrent-rpcs", type=int, default=1024, help="calls in progress, streams included")
    limits.add_argument(
        "--max-attach-per-identity",
        type=int,
        default=DEFAULT_MAX_ATTACH_PER_IDENTITY,
        help="Attach streams (one per edge connection) open at once per identity",
    )
    limits.add_argument(
        "--idle-connection-timeout",
        type=float,
        default=600.0,
        help="seconds before a connection with no call in progress is closed (0: never)",
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (default off)")
    parser.add_argument("--metrics-host", default=None, help="address for /metrics (default: --host)")
    parser.add_argument(
        "--metrics-per-identity",
        action="store_true",
        help="label verified tokens and cut draft nodes by identity in /metrics (identities may be sensitive)",
    )
    parser.add_argument("--log-level", default="INFO")
    fleet = parser.add_argument_group("fleet control plane (needs the mqtt extra)")
    fleet.add_argument(
        "--mqtt", default=None, metavar="URL", help="announce on this broker: mqtt://HOST:PORT (TLS: mqtts://)"
    )
    fleet.add_argument("--server-id", default=None, help="this server's id on the broker (default HOSTNAME-PORT)")
    fleet.add_argument("--advertise-address", default=None, help="HOST:PORT edges dial (default: --host:--port)")
    fleet.add_argument("--announce-period", type=float, default=5.0, help="seconds between status messages")
    add_broker_options(parser)
    return parser.parse_args(argv)


def fleet_config(args: argparse.Namespace):
    if args.mqtt is None:
        return None
    from specedge.fleet.announcer import AnnouncerConfig
    from specedge.fleet.broker import broker_from_args

    return AnnouncerConfig(
        broker=broker_from_args(args.mqtt, args),
        server_id=args.server_id,
        advertise_address=args.advertise_address,
        period_s=args.announce_period,
    )


def _parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """--tp, or the group torchrun started this process in (its WORLD_SIZE)."""
    under_torchrun = torchrun_rank()
    if under_torchrun is None:
        return ParallelConfig(tp=args.tp or 1)
    _, world_size, _ = under_torchrun
    if args.tp not in (None, world_size):
        raise ValueError(f"--tp {args.tp} disagrees with torchrun's WORLD_SIZE {world_size}; leave --tp out there")
    return ParallelConfig(tp=world_size, torchrun=True)


async def _serve(args: argparse.Namespace, parallel: ParallelConfig) -> None:
    from specedge.server.app import ServerConfig, SpecEdgeServer

    config = ServerConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        matmul=args.matmul,
        attention=args.attention,
        cuda_graphs=args.cuda_graphs,
        max_context=args.max_context,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_per_identity=args.metrics_per_identity,
        kv_cache_gb=args.kv_cache_gb,
        draft_model=args.draft_model,
        fleet=fleet_config(args),
        engine=EngineConfig(
            max_sessions=args.max_sessions,
            max_draft_tokens=args.max_draft_tokens,
            max_draft_prob_tokens=args.max_draft_prob_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            max_sessions_per_identity=args.max_sessions_per_identity,
            idle_timeout_s=args.idle_timeout,
            batcher=BatcherConfig(fair_shares=args.fair_shares, step_tokens=args.step_tokens, gather=args.gather),
        ),
        parallel=parallel,
        transport=TransportConfig(
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            insecure=args.insecure,
            max_message_bytes=args.max_message_bytes,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            idle_connection_timeout_s=args.idle_connection_timeout or None,
        ),
        auth_tokens=args.auth_tokens,
        rate_limit=RateLimitConfig(rounds_per_s=args.max_rounds_per_second, burst=args.round_burst),
        max_attach_per_identity=args.max_attach_per_identity,
    )
    server = SpecEdgeServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        address = await server.start()
    except BaseException:
        await server.stop(grace=0)  # what did start (the engine thread, tensor-parallel ranks) stops with us
        raise
    print(f"specedge-server ready on {address}", flush=True)
    stopped, failed = asyncio.create_task(stop.wait()), asyncio.create_task(server.wait_failed())
    await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, failed):
        task.cancel()
    logging.getLogger(__name__).info("shutting down")
    if server.failure is not None:
        await server.stop(grace=1.0)  # in-flight edges get UNAVAILABLE meanwhile
        raise RankFailure(server.failure)
    await server.stop()


def _run_worker(args: argparse.Namespace, rank: int, world_size: int, local_rank: int) -> None:
    """A torchrun rank other than 0: it loads its shard and runs rank 0's steps; rank 0 serves."""
    from specedge.registry import resolve
    from specedge.server.app import ServerConfig
    from specedge.server.attention import resolve_attention
    from specedge.server.loading import weights_dir
    from specedge.server.matmul import resolve_matmul

    config = ServerConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        matmul=args.matmul,
        attention=args.attention,
        parallel=_parallel_config(args),
    )
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    spec = RankSpec(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        model_dir=str(weights_dir(resolve(args.model))),
        device_type=device.type,
        dtype=str(dtype).removeprefix("torch."),
        matmul=resolve_matmul(config.matmul, device, dtype),
        attention=resolve_attention(config.attention, device, dtype),
        store_port=None,
        collective_timeout_s=config.parallel.collective_timeout_s,
        log_level=args.log_level.upper(),
    )
    worker_main(spec)


def make_token(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="specedge-server make-token",
        description="Print a fresh token (line 1: give it to the edge) and its line for the --auth-tokens file "
        "(line 2: only the token's hash, safe to store).",
    )
    parser.add_argument("name", help="the edge's identity: sessions are bound to it")
    name = parser.parse_args(argv).name
    from specedge.server.auth import make_token as new_token

    try:
        token, line = new_token(name)
    except ValueError as exc:
        print(f"specedge-server: {exc}", file=sys.stderr)
        return 2
    print(token)
    print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-token"]:
        return make_token(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specedge.registry import RegistryError

    try:
        parallel = _parallel_config(args)
        under_torchrun = torchrun_rank()
        if under_torchrun is not None and under_torchrun[0] > 0:
            _run_worker(args, *under_torchrun)
            return 0
        asyncio.run(_serve(args, parallel))
    except RankFailure as exc:
        print(f"specedge-server: {exc}; stopped serving", file=sys.stderr)
        return 1
    except (RegistryError, FleetError, ValueError, OSError) as exc:
        print(f"specedge-server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
