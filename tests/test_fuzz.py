"""Fuzzing every RPC of a real server on localhost, while a well-behaved session runs beside it.

A hypothesis state machine sends random and boundary field values, huge and
empty fields, bytes of the wrong message type or no message at all, calls out
of order (verify before open, after close, twice at once, on another
identity's session), with and without valid tokens. Every call must get a
precise status; the server must never fail (no INTERNAL or UNKNOWN), and a
concurrent session driven correctly must stay token-identical to target-only
decoding throughout.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from transformers import AutoModelForCausalLM

from harness import ServerThread
from raw_edge import PROMPT
from reference import greedy_decode
from specedge import wire
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.app import ServerConfig
from specedge.server.auth import make_token
from specedge.server.engine import EngineConfig
from specedge.server.transport import TransportConfig
from specedge.v1 import specedge_pb2 as pb
from specedge.v1 import specedge_pb2_grpc

VOCAB, MAX_CONTEXT, MAX_DRAFT, MAX_Q, MAX_MESSAGE = 384, 64, 8, 8, 64 << 10
MAX_EXAMPLES, STEPS = 120, 25  # about 2,500 calls
PRECISE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}
REQUEST_TYPES = {
    "Handshake": pb.HandshakeRequest,
    "OpenSession": pb.OpenSessionRequest,
    "ContinueSession": pb.ContinueSessionRequest,
    "Verify": pb.VerifyRequest,
    "CloseSession": pb.CloseSessionRequest,
    "Generate": pb.GenerateRequest,
    "Attach": pb.AttachRequest,
}

# -- strategies: boundaries first, then anything ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Repeated:
    """A huge field, kept small in hypothesis's reports: `value` repeated `n` times."""

    value: object
    n: int


def expand(field):
    if not isinstance(field, Repeated):
        return field
    return field.value * field.n if isinstance(field.value, str) else [field.value] * field.n


def message(cls):
    """A builder of `cls` that expands Repeated fields, named like the class in hypothesis's reports."""

    def build(**fields):
        return cls(**{name: expand(value) for name, value in fields.items()})

    build.__name__ = build.__qualname__ = cls.__name__
    return build


uint32 = st.one_of(
    st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, MAX_CONTEXT, 2**31 - 1, 2**31, 2**32 - 1]),
    st.integers(0, 2**32 - 1),
)
token_id = st.one_of(st.integers(0, VOCAB - 1), uint32)
sizes = st.sampled_from([0, 1, 2, MAX_DRAFT - 1, MAX_DRAFT, MAX_DRAFT + 1, MAX_CONTEXT - 1, MAX_CONTEXT, 30_000])
valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_DRAFT)
# Valid lists half the time, so that calls get past validation into the engine. Long
# lists are one value repeated: cheap to make, still over every size limit.
id_lists = st.one_of(valid_ids, valid_ids, st.lists(token_id, max_size=12), st.builds(Repeated, token_id, sizes))
floats = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, float("nan"), float("inf"), float("-inf")]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
texts = st.one_of(st.text(max_size=40), st.builds(Repeated, st.just("x"), st.sampled_from([200, 70_000])))
sampling = st.one_of(
    st.just(pb.SamplingParams()),  # greedy
    st.builds(
        message(pb.SamplingParams),
        temperature=st.floats(0.05, 2.0),
        top_p=st.floats(0.05, 1.0),
        top_k=st.integers(0, 50),
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    ),
    st.builds(
        message(pb.SamplingParams),
        temperature=floats,
        top_p=floats,
        top_k=uint32,
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    ),
)
sparse = st.builds(
    message(pb.SparseDistribution),
    token_ids=st.lists(token_id, max_size=MAX_Q + 2),
    probs=st.lists(floats, max_size=MAX_Q + 2),
)


def fingerprints(valid: pb.TokenizerFingerprint):
    mangled = st.builds(
        message(pb.TokenizerFingerprint),
        vocab_size=uint32,
        num_tokens=uint32,
        vocab_sha256=texts,
        bos_token_id=st.one_of(st.none(), uint32),
        eos_token_ids=st.lists(uint32, max_size=4),
    )
    return st.one_of(st.just(valid), st.just(valid), st.just(valid), st.just(pb.TokenizerFingerprint()), mangled)


# -- the well-behaved session, in its own thread ----------------------------------------


class GoodEdge(threading.Thread):
    """Opens, verifies with the target's own continuation as drafts, closes, again: its output must never change."""

    def __init__(self, channel: grpc.Channel, fingerprint: pb.TokenizerFingerprint, expected: list[int]):
        super().__init__(daemon=True)
        self.stub = specedge_pb2_grpc.SpecEdgeStub(channel)
        self.fingerprint, self.expected = fingerprint, expected
        self.stop = threading.Event()
        self.outputs: list[list[int]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.outputs.append(self.generate_once())
        except BaseException as exc:  # reported by the test
            self.error = exc

    def generate_once(self) -> list[int]:
        request = pb.OpenSessionRequest(
            tokenizer=self.fingerprint, prompt_token_ids=PROMPT, max_new_tokens=len(self.expected)
        )
        opened = self.stub.OpenSession(request, timeout=30)
        tokens, finish = [opened.first_token_id], opened.finish_reason
        while finish == pb.FINISH_REASON_NONE:
            drafts = self.expected[len(tokens) : len(tokens) + 3]
            request = pb.VerifyRequest(session_id=opened.session_id, draft_token_ids=drafts, num_generated=len(tokens))
            reply = self.stub.Verify(request, timeout=30)
            tokens += reply.token_ids
            finish = reply.finish_reason
            time.sleep(0.01)  # an edge drafting between rounds; leaves the fuzzer the CPU
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), timeout=30)
        return tokens


def token_channel(address: str, token: str | None) -> grpc.Channel:
    options = [("grpc.use_local_subchannel_pool", 1)]
    if token is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.composite_channel_credentials(
        grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP), grpc.access_token_call_credentials(token)
    )
    return grpc.secure_channel(address, credentials, options=options)


@pytest.fixture(scope="module")
def fuzz_server(tiny_target_dir, tmp_path_factory):
    tokens = {name: make_token(name) for name in ("good", "fuzzer", "other")}
    token_file = tmp_path_factory.mktemp("fuzz") / "tokens"
    token_file.write_text("".join(line + "\n" for _, line in tokens.values()))
    engine = EngineConfig(
        max_sessions=10, max_sessions_per_identity=6, max_draft_tokens=MAX_DRAFT, max_draft_prob_tokens=MAX_Q
    )
    config = ServerConfig(
        model=str(tiny_target_dir),
        port=0,
        max_context=MAX_CONTEXT,
        engine=engine,
        auth_tokens=str(token_file),
        transport=TransportConfig(max_message_bytes=MAX_MESSAGE),
    )
    with ServerThread(config) as server:
        yield server, {name: token for name, (token, _) in tokens.items()}


def test_fuzz_every_rpc_while_a_good_session_stays_lossless(fuzz_server, tiny_target_dir):
    server, tokens = fuzz_server
    valid_fp = wire.fingerprint_to_proto(HFTokenizer(tiny_target_dir).fingerprint)
    expected = greedy_decode(AutoModelForCausalLM.from_pretrained(tiny_target_dir), PROMPT, 11, {2})
    channels = {name: token_channel(server.address, token) for name, token in tokens.items()}
    channels["lease"] = token_channel(server.address, tokens["fuzzer"])  # the fuzzer's identity, another connection
    channels["none"] = token_channel(server.address, None)
    channels["wrong"] = token_channel(server.address, "se_" + "w" * 43)
    stubs = {name: specedge_pb2_grpc.SpecEdgeStub(channel) for name, channel in channels.items()}
    statuses: collections.Counter[tuple[str, str]] = collections.Counter()

    def call(name: str, method, request):
        """One unary call (or a future's result): its status, checked to be precise, its details and its reply."""
        try:
            reply = method(request, timeout=30) if callable(method) else method.result()
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            reply, code, details = None, exc.code(), exc.details()
        statuses[name, code.name] += 1
        assert code in PRECISE, (name, code, details, request if len(str(request)) < 2000 else "(large)")
        assert code == grpc.StatusCode.OK or details, (name, code)
        return code, details, reply

    well_formed_open = st.builds(
        pb.OpenSessionRequest,
        tokenizer=st.just(valid_fp),
        prompt_token_ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
        max_new_tokens=st.integers(0, MAX_CONTEXT),
        sampling=sampling,
    )

    class Fuzzer(RuleBasedStateMachine):
        sessions = Bundle("sessions")

        def __init__(self):
            super().__init__()
            self.stub = stubs["fuzzer"]
            self.live: dict[str, int] = {}  # session id -> tokens generated, as the fuzzer believes

        @initialize(target=sessions, request=well_formed_open)
        def start(self, request):
            """Every example starts with one session open, so that later calls reach the engine."""
            statuses["examples", "n"] += 1
            return self.open_session(request)

        @rule(
            target=sessions,
            request=st.one_of(
                well_formed_open,
                st.builds(
                    message(pb.OpenSessionRequest),
                    tokenizer=fingerprints(valid_fp),
                    prompt_token_ids=id_lists,
                    max_new_tokens=uint32,
                    sampling=sampling,
                ),
            ),
        )
        def open_session(self, request):
            _, _, reply = call("OpenSession", self.stub.OpenSession, request)
            if reply is None:
                return "never-opened"  # what hypothesis draws must not depend on the server's answers
            assert 0 <= reply.first_token_id < VOCAB and reply.limits.max_draft_tokens == MAX_DRAFT
            self.live[reply.session_id] = 1
            return reply.session_id

        @rule(
            session=st.one_of(sessions, sessions, texts),
            keep=st.one_of(st.just(0), st.just(0), uint32),
            tokens=id_lists,
            max_new_tokens=st.one_of(st.integers(0, MAX_CONTEXT), uint32),
            sampling=sampling,
        )
        def continue_session(self, session, keep, tokens, max_new_tokens, sampling):
            """A new turn, in order or not: kept tokens beyond the session, empty turns, turns while in flight."""
            session, tokens = expand(session), expand(tokens)
            request = pb.ContinueSessionRequest(
                session_id=session,
                keep_tokens=keep,
                token_ids=tokens,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
            )
            _, _, reply = call("ContinueSession", self.stub.ContinueSession, request)
            if reply is not None:
                assert reply.session_id == session and 0 <= reply.first_token_id < VOCAB
                self.live[session] = 1

        @rule(
            session=st.one_of(sessions, sessions, texts),
            drafts=id_lists,
            parents=st.one_of(st.just([]), st.just([]), id_lists),
            num_generated=st.one_of(st.just(None), st.just(None), uint32),
            dists=st.one_of(st.just([]), st.just([]), st.lists(sparse, max_size=MAX_DRAFT + 1)),
        )
        def verify(self, session, drafts, parents, num_generated, dists):
            session, drafts, parents = expand(session), expand(drafts), expand(parents)
            known = self.live.get(session, 1)
            request = pb.VerifyRequest(
                session_id=session,
                draft_token_ids=drafts,
                draft_parents=parents,
                num_generated=known if num_generated is None else num_generated,
                draft_probs=dists,
            )
            _, _, reply = call("Verify", self.stub.Verify, request)
            if reply is None:
                return
            assert len(reply.accepted_nodes) <= len(drafts) and 1 <= len(reply.token_ids) <= len(drafts) + 1
            self.live[session] = reply.num_generated

        @rule(session=sessions, data=st.data())
        def well_formed_round(self, session, data):
            """A round that passes validation: random tokens in a random tree (or chain, maybe with q)."""
            drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=MAX_DRAFT), label="drafts")
            shape = data.draw(st.sampled_from(["chain", "tree", "chain with q"]), label="shape")
            parents = [data.draw(st.integers(0, i)) for i in range(len(drafts))] if shape == "tree" else []
            dists = (
                [
                    pb.SparseDistribution(token_ids=[t, (t + 1) % VOCAB], probs=[p, 1 - p])
                    for t, p in zip(
                        drafts, data.draw(st.lists(st.floats(0.05, 1.0), min_size=len(drafts), max_size=len(drafts)))
                    )
                ]
                if shape == "chain with q"
                else []
            )
            known = self.live.get(session, 1)
            request = pb.VerifyRequest(
                session_id=session,
                draft_token_ids=drafts,
                draft_parents=parents,
                num_generated=known,
                draft_probs=dists,
            )
            code, details, reply = call("Verify(well-formed)", self.stub.Verify, request)
            if reply is None:
                # Finished, or out of sync (a lease's end is closing it); never opened, or closed.
                assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), details
                return
            nodes = list(reply.accepted_nodes)
            tree_parents = parents or list(range(len(drafts)))
            assert all(tree_parents[node - 1] == (nodes[i - 1] if i else 0) for i, node in enumerate(nodes))  # a path
            assert reply.token_ids[: len(nodes)] == [drafts[node - 1] for node in nodes]
            assert len(reply.token_ids) in (len(nodes), len(nodes) + 1)  # + the target's own token, unless stopped
            assert reply.num_generated == known + len(reply.token_ids)
            self.live[session] = reply.num_generated

        @rule(session=st.one_of(sessions, texts), racing=st.integers(2, 4))
        def verify_twice_at_once(self, session, racing):
            session = expand(session)
            request = pb.VerifyRequest(session_id=session, num_generated=self.live.get(session, 1))
            futures = [self.stub.Verify.future(request, timeout=30) for _ in range(racing)]
            codes = []
            for future in futures:
                code, _, reply = call("Verify(racing)", future, request)
                codes.append(code)
                if reply is not None:
                    self.live[session] = reply.num_generated
            assert codes.count(grpc.StatusCode.OK) <= 1  # a session runs one round at a time

        @rule(session=st.one_of(sessions, texts))
        def close(self, session):
            session = expand(session)
            code, _, _ = call("CloseSession", self.stub.CloseSession, pb.CloseSessionRequest(session_id=session))
            if session in self.live:
                assert code == grpc.StatusCode.OK
                del self.live[session]

        @rule(session=sessions, intruder=st.sampled_from(["other", "none", "wrong"]))
        def touch_another_identitys_session(self, session, intruder):
            request = pb.VerifyRequest(session_id=session, num_generated=self.live.get(session, 1))
            code, _, _ = call("Verify(intruder)", stubs[intruder].Verify, request)
            if intruder != "other":
                assert code == grpc.StatusCode.UNAUTHENTICATED
            elif session in self.live:
                assert code == grpc.StatusCode.PERMISSION_DENIED
            else:
                assert code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)

        @rule(
            request=st.builds(
                message(pb.HandshakeRequest),
                protocol_version=st.one_of(st.just(1), uint32),
                draft_tokenizer=fingerprints(valid_fp),
                client_name=texts,
            ),
            who=st.sampled_from(["fuzzer", "fuzzer", "none", "wrong"]),
        )
        def handshake(self, request, who):
            code, _, _ = call("Handshake", stubs[who].Handshake, request)
            if who != "fuzzer" and request.ByteSize() <= MAX_MESSAGE:  # gRPC measures a message before any handler
                assert code == grpc.StatusCode.UNAUTHENTICATED

        @rule(
            request=st.builds(
                message(pb.GenerateRequest),
                tokenizer=fingerprints(valid_fp),
                prompt_token_ids=id_lists,
                max_new_tokens=uint32,
                sampling=sampling,
                server_draft_tokens=uint32,
            ),
            read=st.integers(0, 3),
        )
        def generate(self, request, read):
            stream = self.stub.Generate(request, timeout=30)
            try:
                for _ in range(read):
                    reply = next(stream)
                    assert all(0 <= t < VOCAB for t in reply.token_ids)
                code = grpc.StatusCode.OK  # what was read was fine; the rest is abandoned
            except StopIteration:
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in PRECISE and exc.details(), (code, exc.details())
            stream.cancel()  # an edge walking away mid-stream
            statuses["Generate", code.name] += 1

        @rule(
            method=st.sampled_from(sorted(REQUEST_TYPES)),
            data=st.one_of(
                st.binary(max_size=64),
                st.builds(
                    lambda m: m.SerializeToString(),
                    st.sampled_from(
                        [
                            pb.VerifyRequest(session_id="s", draft_token_ids=[1, 2]),
                            pb.OpenSessionRequest(prompt_token_ids=[5]),
                            pb.ServerLimits(max_sessions=3),
                            pb.GenerateResponse(token_ids=[1]),
                        ]
                    ),
                ),
            ),
        )
        def raw_bytes(self, method, data):
            """Bytes of another message type, or of none: wrong types, truncations, bad UTF-8."""
            if method == "Attach":
                return  # a stream that never ends by design: covered by `attach`
            send = channels["fuzzer"].unary_unary(f"/specedge.v1.SpecEdge/{method}")
            if method == "Generate":
                send = channels["fuzzer"].unary_stream(f"/specedge.v1.SpecEdge/{method}")
                stream = send(data, timeout=30)
                try:
                    next(stream, None)
                    code, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details()
                stream.cancel()
                statuses["raw Generate", code.name] += 1
                assert code in PRECISE, (code, details)
                return
            code, details, _ = call(f"raw {method}", send, data)
            try:
                REQUEST_TYPES[method].FromString(data)
            except Exception:
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "is not a valid specedge.v1." in details, details

        @rule(who=st.sampled_from(["lease", "lease", "lease", "fuzzer", "none", "wrong"]))
        def attach(self, who):
            """A lease on another connection ("lease"), or on the fuzzer's own, whose end closes its sessions."""
            admitted = who in ("lease", "fuzzer")
            # A lease never ends by itself: wait briefly when it will be admitted, long enough when refused.
            stream = stubs[who].Attach(pb.AttachRequest(), timeout=0.02 if admitted else 30)
            try:
                next(stream)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            statuses["Attach", code.name] += 1
            assert code == (grpc.StatusCode.DEADLINE_EXCEEDED if admitted else grpc.StatusCode.UNAUTHENTICATED)
            deadline = time.monotonic() + 5
            while server.server.engine._leases and time.monotonic() < deadline:  # the server saw the lease end
                time.sleep(0.001)
            if who == "fuzzer":
                self.live.clear()  # the lease's end closed every session of this connection

        def teardown(self):
            for session in list(self.live):
                call("CloseSession", self.stub.CloseSession, pb.CloseSessionRequest(session_id=session))

    good = GoodEdge(channels["good"], valid_fp, expected)
    good.start()
    started = time.monotonic()
    try:
        run_state_machine_as_test(
            Fuzzer,
            settings=settings(
                max_examples=MAX_EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
                # No shrinking: replays against a live server (timing, leases) are not exact, and a
                # failing sequence is reported as found.
                phases=[Phase.explicit, Phase.generate],
            ),
        )
    finally:
        good.stop.set()
        good.join(timeout=60)
    elapsed = time.monotonic() - started

    assert good.error is None, repr(good.error)
    assert len(good.outputs) >= 5 and all(output == expected for output in good.outputs)
    num_calls = sum(count for (name, _), count in statuses.items() if name != "examples")
    by_rpc = collections.Counter()
    for (name, _), count in statuses.items():
        by_rpc[name.split("(")[0].removeprefix("raw ")] += count
    print(
        f"\nfuzz: {num_calls} calls in {statuses['examples', 'n']} examples, {elapsed:.0f} s; "
        f"good session ran {len(good.outputs)} times; statuses: {dict(statuses)}"
    )
    assert num_calls >= 2000
    assert all(by_rpc[name] >= 50 for name in REQUEST_TYPES), by_rpc
    verified = sum(statuses[name, "OK"] for name in ("Verify", "Verify(racing)", "Verify(well-formed)"))
    assert statuses["OpenSession", "OK"] >= 50 and verified >= 20  # the fuzzer got deep, too
    # The server is alive and leaks nothing once the fuzzer is gone.
    for channel in channels.values():
        channel.close()
    engine = server.server.engine
    deadline = time.monotonic() + 10
    while engine.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.sessions and engine.slots.num_free == engine.slots.num_slots
    assert all(not task.done() for task in engine._tasks)
