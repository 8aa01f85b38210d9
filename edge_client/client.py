"""The edge's connection to a server: handshake, lease, one method per RPC, and reconnecting.

What an answer does with these calls (drafting, proactive drafting,
resuming, falling back) lives in edge_client/generation.py, which uses a
client; the client knows nothing of answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

import grpc

from specedge import wire
from specedge.edge_client.channel import ChannelSecurity, open_channel
from specedge.edge_client.rounds import DraftRound, OpenedSession, RoundReply, ServerInfo, StreamedTokens
from specedge.ratelimit import TokenBucket
from specedge.tokens import IncompatibleTokenizer, TokenizerFingerprint, check_compatible
from specedge.types import SamplingParams
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

log = logging.getLogger(__name__)

MAX_RETRIES = 3  # of a call refused with RESOURCE_EXHAUSTED and a retry-after-ms trailer
MAX_RETRY_AFTER_MS = 10_000
# Chooses the RPC on the stub of the moment (`lambda stub: stub.Verify`): a call goes out on the connection
# that is current when it is issued, not the one current when it was queued behind a delay.
Pick = Callable[[specedge_pb2_grpc.SpecEdgeStub], Callable]


class EdgeError(Exception):
    """A failure the user can act on; the message is one line."""

    def __init__(self, message: str, *, status: str | None = None):
        super().__init__(message)
        self.status = status  # the gRPC status name when the server refused (e.g. "RESOURCE_EXHAUSTED")


class Lost(EdgeError):
    """An answer's session is gone: with its connection (ConnectionLost) or alone (SessionGone).

    `epoch` is the connection the failing call went out on; EdgeClient.recover() uses it to reconnect
    once per broken connection, however many answers notice, and whenever they do.
    """

    def __init__(self, message: str, *, status: str | None = None, epoch: int | None = None):
        super().__init__(message, status=status)
        self.epoch = epoch  # None: the current connection


class ConnectionLost(Lost):
    """The server could not be reached (down, restarting, or the network dropped)."""


class SessionGone(Lost):
    """The server no longer knows the session (it expired, the server restarted, or its connection was replaced)."""


@dataclasses.dataclass(frozen=True)
class ConnectionConfig:
    """How the edge reaches its server; what an answer asks of it is its SpeculationPolicy (policy.py)."""

    security: ChannelSecurity = ChannelSecurity()  # TLS and the bearer token (edge_client/channel.py)
    rpc_timeout_s: float = 120.0  # per RPC; a verify round normally takes well under a second
    # After a lost connection: how long to keep trying to reconnect (backing off from 0.1 s to 5 s) and resume.
    reconnect_timeout_s: float = 30.0
    # Ping the server this often, and count the connection lost when a ping goes unanswered this long: a path that
    # died silently (a NAT that forgot the connection, a laptop on another network) is found in seconds, and the
    # answers resume, where each call used to wait out rpc_timeout_s and fail. The server accepts pings every
    # second or more (server/transport.py).
    keepalive_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    # An emulated network, injected on the edge side: each RPC waits rtt/2 each
    # way, plus uniform jitter in [0, jitter].
    simulated_rtt_ms: float = 0.0
    simulated_jitter_ms: float = 0.0

    def __post_init__(self):
        if self.rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be > 0, got {self.rpc_timeout_s}")
        if min(self.simulated_rtt_ms, self.simulated_jitter_ms, self.reconnect_timeout_s) < 0:
            raise ValueError("simulated delays and the reconnect timeout must be >= 0")
        if not (self.keepalive_s >= wire.MIN_PING_INTERVAL_S and self.keepalive_timeout_s > 0):
            raise ValueError(
                f"keepalive must ping every {wire.MIN_PING_INTERVAL_S:g} s or less often (servers refuse more), "
                "with a timeout > 0"
            )


def _explain(exc: grpc.aio.AioRpcError, address: str, epoch: int) -> EdgeError:
    """The EdgeError for a failed call that went out on connection `epoch`."""
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return SessionGone(exc.details(), status=exc.code().name, epoch=epoch)
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "is draining" in (exc.details() or ""):
        return ConnectionLost(f"{exc.details()} (at {address})", epoch=epoch)  # it answered: no new sessions
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        why = f"cannot reach the server at {address} ({exc.details()}); is specedge-server running there?"
        return ConnectionLost(why, epoch=epoch)
    if exc.code() == grpc.StatusCode.CANCELLED:  # not by our caller (that raises CancelledError): a closed channel
        return ConnectionLost(f"the call to {address} was cut short ({exc.details()})", epoch=epoch)
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EdgeError(f"the server at {address} did not answer in time", status=exc.code().name)
    return EdgeError(f"server refused: {exc.code().name}: {exc.details()}", status=exc.code().name)


def _retry_after_s(exc: grpc.aio.AioRpcError) -> float | None:
    """How long a RESOURCE_EXHAUSTED refusal asks us to wait before retrying (capped); None: do not retry."""
    value = dict(exc.trailing_metadata() or ()).get(wire.RETRY_AFTER_TRAILER)
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or not isinstance(value, str) or not value.isdigit():
        return None
    return min(int(value), MAX_RETRY_AFTER_MS) / 1000


def _over_round_rate(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the server refused the call for its identity's round rate (not for KV slots or memory)."""
    return dict(exc.trailing_metadata() or ()).get(wire.LIMIT_TRAILER) == wire.LIMIT_ROUND_RATE


def _cancelled_by_caller() -> bool:
    """Whether the running task was asked to stop, rather than hit by a local cancel of one of its calls.

    grpc raises CancelledError in every call in flight on a channel that is closed, and reconnect() closes
    the channel that all of this client's answers share: for the others that is a lost connection.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class EdgeClient:
    """One connection to a server. Use as `async with EdgeClient(address, fingerprint) as client:`."""

    def __init__(
        self,
        address: str,
        fingerprint: TokenizerFingerprint,
        *,
        config: ConnectionConfig = ConnectionConfig(),
        choose_address: Callable[[], Awaitable[str]] | None = None,
    ):
        self.address = address
        self.fingerprint = fingerprint
        self.config = config
        # Fleet discovery: asked which server to use on every (re)connect. With it, `abandon()` moves
        # this client off its server (draining, offline), and resumed sessions land where it points.
        self.choose_address = choose_address
        self._pace: TokenBucket | None = None  # the server's per-identity round rate, when it has one
        self._channel: grpc.aio.Channel | None = None
        self._stub: specedge_pb2_grpc.SpecEdgeStub | None = None
        self._lease: grpc.aio.UnaryStreamCall | None = None
        self.server_info: ServerInfo | None = None
        self._rng = random.Random()
        self._left: asyncio.Future | None = None  # with choose_address: resolves to why this server must be left
        self._epoch = 0  # connections made; a failed call names the one it went out on, so answers share a reconnect
        self._reconnecting = asyncio.Lock()

    async def __aenter__(self) -> EdgeClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._disconnect()

    async def connect(self) -> None:
        await self._disconnect()
        if self.choose_address is not None:
            self.address = await self.choose_address()
            self._left = asyncio.get_running_loop().create_future()
        keepalive = (self.config.keepalive_s, self.config.keepalive_timeout_s)
        self._channel = open_channel(self.address, self.config.security, keepalive)
        self._stub = specedge_pb2_grpc.SpecEdgeStub(self._channel)
        await self.handshake()
        # The connection's lease: if this process dies, the server frees our slots at once.
        self._lease = self._stub.Attach(pb.AttachRequest())
        self._epoch += 1

    async def reconnect(self, timeout_s: float | None = None, *, lost: int | None = None) -> None:
        """Connect again, with exponential backoff, for up to `timeout_s` (default: the config's).

        `lost`: the epoch of the connection a call failed on (default: the current one). When the client
        has connected since, there is nothing to do: another answer already replaced that connection, and
        replacing it again would cancel the new one's lease, and with it every session opened on it.
        """
        epoch = self._epoch if lost is None else lost
        async with self._reconnecting:
            if self._epoch > epoch and not self.must_leave:
                return
            deadline = time.monotonic() + (self.config.reconnect_timeout_s if timeout_s is None else timeout_s)
            backoff = 0.1
            while True:
                try:
                    await self.connect()
                    return
                except ConnectionLost:
                    if time.monotonic() + backoff > deadline:
                        raise
                    log.info("server at %s unreachable; retrying in %.1f s", self.address, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)

    async def recover(self, lost: Lost) -> None:
        """Make the connection fit to re-open a session after `lost`.

        A session lost alone (expired, or closed with an older connection's lease) is re-opened on this
        connection while its lease holds: reconnecting would close the other answers' sessions for nothing.
        A lost connection is replaced once, by whichever answer notices first (see reconnect).
        """
        if isinstance(lost, SessionGone) and self._lease is not None and not self._lease.done():
            return
        await self.reconnect(lost=lost.epoch)

    def abandon(self, reason: str) -> None:
        """Leave this server (it is draining or went offline): calls in flight and later ones raise
        ConnectionLost, so each answer resumes through reconnect() on the server choose_address picks.

        Only with choose_address: without discovery there is nowhere else to go.
        """
        if self._left is not None and not self._left.done():
            log.warning("leaving the server at %s: %s", self.address, reason)
            self._left.set_result(reason)

    @property
    def must_leave(self) -> bool:
        return self._left is not None and self._left.done()

    async def ensure_connected(self) -> None:
        """Before a new answer: move first if this server was abandoned (new sessions go elsewhere)."""
        if self.must_leave:
            await self.reconnect()

    def _leaving(self, left: asyncio.Future, epoch: int) -> ConnectionLost:
        return ConnectionLost(f"left the server at {self.address}: {left.result()}", epoch=epoch)

    def _lost_channel(self, epoch: int) -> ConnectionLost:
        """A call cut short by a reconnect: its channel was closed (or was being replaced) under it."""
        return ConnectionLost(f"the connection to {self.address} was replaced while a call was on it", epoch=epoch)

    async def _unless_left(self, awaitable, rpc, epoch: int):
        """Await an RPC or a stream read; if this server is abandoned first, cancel `rpc` and raise ConnectionLost."""
        left = self._left
        if left is None:
            return await awaitable
        if left.done():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            rpc.cancel()
            raise self._leaving(left, epoch)
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait((task, left), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            rpc.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        rpc.cancel()
        raise self._leaving(left, epoch)

    async def _disconnect(self) -> None:
        # Forget the connection before awaiting anything: a call issued from now on must not pick up the
        # channel being closed (grpc would raise UsageError), but fail as lost on this epoch.
        lease, channel = self._lease, self._channel
        self._lease = self._channel = self._stub = None
        if lease is not None:
            lease.cancel()
        if channel is not None:
            await channel.close()

    def _one_way_s(self) -> float:
        """Half an emulated round trip plus jitter, in seconds; 0 without a simulated network."""
        config = self.config
        if not (config.simulated_rtt_ms or config.simulated_jitter_ms):
            return 0.0
        return (config.simulated_rtt_ms / 2 + self._rng.uniform(0.0, config.simulated_jitter_ms)) / 1e3

    async def _network_delay(self) -> None:
        if delay := self._one_way_s():
            await asyncio.sleep(delay)

    def _current(self) -> tuple[specedge_pb2_grpc.SpecEdgeStub, int]:
        """The stub to issue a call on, with its epoch; both read at once, so a call is blamed on its own connection."""
        if self._left is not None and self._left.done():  # must_leave
            raise self._leaving(self._left, self._epoch)
        if self._stub is None:
            raise self._lost_channel(self._epoch)  # between connections: reconnect() is under way
        return self._stub, self._epoch

    async def _call(self, pick: Pick, request, *, paced: bool = False, **options):
        """One unary RPC: `pick` chooses it on the stub of the moment (after the emulated network's delay); `paced`,
        a round, whose retries queue in the pace (_back_off)."""
        await self._network_delay()
        for attempt in range(MAX_RETRIES + 1):
            stub, epoch = self._current()
            try:
                rpc = pick(stub)(request, timeout=self.config.rpc_timeout_s, **options)
                reply = await self._unless_left(rpc, rpc, epoch)
                break
            except grpc.aio.AioRpcError as exc:
                if (wait_s := _retry_after_s(exc)) is not None and attempt < MAX_RETRIES:
                    # Refused before anything happened: the same call again.
                    await self._back_off(wait_s, paced and _over_round_rate(exc))
                    continue
                raise _explain(exc, self.address, epoch) from None
            except grpc.aio.UsageError:  # "Channel is closed": another answer's reconnect closed it just now
                raise self._lost_channel(epoch) from None
            except asyncio.CancelledError:
                if _cancelled_by_caller():
                    raise
                raise self._lost_channel(epoch) from None
        await self._network_delay()
        return reply

    async def _back_off(self, wait_s: float, over_rate: bool) -> None:
        """Wait out a refusal that said when to come back. A round refused for the server's round rate (paced
        rounds are refused so only when the network held them and delivered several at once) holds the pace until
        then and queues in it: the answers refused together come back one by one, not all at once, to be refused
        together again (as they were, three times, until an answer failed). Other refusals (no KV slot free) wait
        alone: the other answers' rounds are not held for them."""
        if over_rate and self._pace is not None:
            self._pace.hold(wait_s)
            wait_s = self._pace.reserve()
        await asyncio.sleep(wait_s)

    async def _round(self, pick: Pick, request):
        """OpenSession, ContinueSession, Verify: paced to the server's round rate, so it never refuses one."""
        if self._pace is not None and (delay_s := self._pace.reserve()):
            await asyncio.sleep(delay_s)
        return await self._call(pick, request, paced=True)

    async def handshake(self) -> ServerInfo:
        request = pb.HandshakeRequest(
            protocol_version=wire.PROTOCOL_VERSION,
            draft_tokenizer=wire.fingerprint_to_proto(self.fingerprint),
            client_name="specedge-edge",
        )
        info = wire.server_info_from_proto(await self._call(lambda stub: stub.Handshake, request, wait_for_ready=False))
        try:  # the server checks too; checking here gives the same answer without trusting it
            check_compatible(self.fingerprint, info.target_tokenizer)
        except IncompatibleTokenizer as exc:
            raise EdgeError(f"draft is not compatible with the server's model {info.model_name}: {exc}") from None
        self.server_info = info
        if info.limits.max_rounds_per_second > 0:
            # A tenth below the limit, so that jitter in when rounds reach the server never pushes one over.
            self._pace = TokenBucket(0.9 * info.limits.max_rounds_per_second, max(1, info.limits.round_burst))
        return info

    # -- one method per RPC --------------------------------------------------

    async def open_session(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams, seed: int | None
    ) -> OpenedSession:
        request = pb.OpenSessionRequest(
            tokenizer=wire.fingerprint_to_proto(self.fingerprint),
            prompt_token_ids=prompt,
            max_new_tokens=max_new_tokens,
            sampling=wire.sampling_to_proto(sampling, seed),
        )
        return wire.opened_from_proto(await self._round(lambda stub: stub.OpenSession, request))

    async def continue_session(
        self,
        session_id: str,
        keep_tokens: int,
        new_tokens: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        seed: int | None,
    ) -> OpenedSession:
        request = pb.ContinueSessionRequest(
            session_id=session_id,
            keep_tokens=keep_tokens,
            token_ids=new_tokens,
            max_new_tokens=max_new_tokens,
            sampling=wire.sampling_to_proto(sampling, seed),
        )
        return wire.opened_from_proto(await self._round(lambda stub: stub.ContinueSession, request))

    async def verify(self, session_id: str, draft: DraftRound) -> RoundReply:
        request = wire.draft_round_to_proto(session_id, draft)
        return wire.round_reply_from_proto(await self._round(lambda stub: stub.Verify, request))

    async def close_session(self, session_id: str) -> None:
        """Free the server's slot; shielded so that a cancelled generation still frees it."""
        stub = self._stub
        if stub is None:
            return  # between connections: the old one's lease took its sessions with it
        try:
            await asyncio.shield(stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=5))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError):
            pass  # the server's idle timeout (or the broken lease) frees the slot anyway

    async def generate_stream(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        seed: int | None,
        server_draft_tokens: int = 0,
    ) -> AsyncGenerator[StreamedTokens, None]:
        """Server-driven generation, one message per step, each delivered half a round trip after it left."""
        request = pb.GenerateRequest(
            tokenizer=wire.fingerprint_to_proto(self.fingerprint),
            prompt_token_ids=prompt,
            max_new_tokens=max_new_tokens,
            sampling=wire.sampling_to_proto(sampling, seed),
            server_draft_tokens=server_draft_tokens,
        )
        await self._network_delay()
        stub, epoch = self._current()
        # No overall deadline: a long answer streams for as long as it takes;
        # a dead server breaks the stream with UNAVAILABLE.
        try:
            call = stub.Generate(request)
        except grpc.aio.UsageError:
            raise self._lost_channel(epoch) from None
        try:
            async for reply, arrived in self._timestamped(call, epoch):
                # Messages pipeline: each is due one way after it arrived, not after the one before.
                await asyncio.sleep(max(0.0, arrived + self._one_way_s() - time.monotonic()))
                yield wire.streamed_from_proto(reply)
        except grpc.aio.AioRpcError as exc:
            raise _explain(exc, self.address, epoch) from None
        except asyncio.CancelledError:
            if _cancelled_by_caller():
                raise
            raise self._lost_channel(epoch) from None
        finally:
            call.cancel()  # a no-op after the last message; frees the server's session when stopped early

    async def _timestamped(self, call, epoch: int):
        """The stream's messages with their arrival times, read as they come even while the consumer sleeps."""
        if not (self.config.simulated_rtt_ms or self.config.simulated_jitter_ms):
            while (reply := await self._unless_left(call.read(), call, epoch)) is not grpc.aio.EOF:
                yield reply, time.monotonic()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def read():
            try:
                async for reply in call:
                    queue.put_nowait((reply, time.monotonic(), None))
                queue.put_nowait((None, 0.0, None))
            except grpc.aio.AioRpcError as exc:
                queue.put_nowait((None, 0.0, exc))
            except asyncio.CancelledError as exc:
                if _cancelled_by_caller():  # stopped below, once the consumer is done
                    raise
                queue.put_nowait((None, 0.0, exc))  # the channel was closed: the consumer must not wait forever

        reader = asyncio.create_task(read())
        try:
            while True:
                reply, arrived, error = await self._unless_left(queue.get(), call, epoch)
                if error is not None:
                    raise error
                if reply is None:
                    return
                yield reply, arrived
        finally:
            reader.cancel()
