"""Identity and transport: tokens on every call, sessions bound to identities, TLS and mutual TLS.

Certificates are made with trustme (harness.make_pki); servers run on loopback sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time

import grpc
import pytest
from transformers import AutoModelForCausalLM

from harness import ServerThread, make_pki, start_server_process
from raw_edge import PROMPT, Edge, status_of, until
from reference import greedy_decode
from specedge import wire
from specedge.edge_client.channel import ChannelSecurity, open_channel
from specedge.edge_client.client import ConnectionConfig, EdgeClient, EdgeError
from specedge.edge_client.generation import generate
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.tokenizer import HFTokenizer
from specedge.server.app import ServerConfig
from specedge.server.auth import make_token, parse_token_file
from specedge.server.engine import EngineConfig
from specedge.server.transport import TransportConfig
from specedge.v1 import specedge_pb2 as pb

UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


def write_atomically(path, text: str) -> None:
    """As SECURITY.md tells operators to edit the token file: write beside it, then rename over it."""
    temporary = f"{path}.new"
    with open(temporary, "w") as out:
        out.write(text)
    os.replace(temporary, path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """PEM files: the server's CA and certificate, the edges' CA and one edge's certificate, and a rogue's."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> dict[str, str]:
    made = {name: make_token(name) for name in ("alice", "bob")}
    path = tmp_path_factory.mktemp("auth") / "tokens"
    write_atomically(path, "# edges allowed on this server\n" + "".join(f"{line}\n" for _, line in made.values()))
    return {"file": str(path), **{name: token for name, (token, _) in made.items()}}


@pytest.fixture(scope="module")
def fingerprint(tiny_target_dir):
    return HFTokenizer(tiny_target_dir).fingerprint


@pytest.fixture(scope="module")
def mtls_server(tiny_target_dir, pki, tokens):
    """The recommended deployment: TLS, edge certificates required, and tokens."""
    transport = TransportConfig(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["client_ca"])
    config = ServerConfig(
        model=str(tiny_target_dir),
        port=0,
        max_context=128,
        transport=transport,
        auth_tokens=tokens["file"],
        engine=EngineConfig(max_sessions=6),
    )
    with ServerThread(config) as server:
        yield server


def edge_security(pki, token: str | None, *, cert: str = "client", ca: str = "server_ca") -> ChannelSecurity:
    return ChannelSecurity(token=token, tls_ca=pki[ca], tls_cert=pki[f"{cert}_cert"], tls_key=pki[f"{cert}_key"])


def test_token_file_lines_and_their_errors(tmp_path):
    token, line = make_token("edge-7")
    name, digest = line.split(":")
    assert name == "edge-7" and token.startswith("se_") and len(token) > 40
    assert digest == hashlib.sha256(token.encode()).hexdigest()
    assert parse_token_file(["# comment", "", line], "f") == [("edge-7", bytes.fromhex(digest))]
    bad = {
        "nocolon": "f:1: expected 64 lowercase hex digits",
        "edge:abc": "f:1: expected 64 lowercase hex digits",
        f"bad name:{digest}": "f:1: invalid identity name 'bad name'",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_token_file([text], "f")
    with pytest.raises(ValueError, match="f:2: this token hash is listed twice"):
        parse_token_file([line, f"other:{digest}"], "f")
    with pytest.raises(ValueError, match="invalid identity name"):
        make_token("a:b")


def test_make_token_prints_the_token_then_its_line():
    command = [os.path.join(os.path.dirname(sys.executable), "specedge-server"), "make-token", "laptop-1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    token, line = result.stdout.splitlines()
    assert line == f"laptop-1:{hashlib.sha256(token.encode()).hexdigest()}"
    refused = subprocess.run([*command[:-1], "no:colons"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "invalid identity name" in refused.stderr


def test_plaintext_is_refused_off_loopback_unless_insecure(tiny_target_dir):
    with pytest.raises(ValueError, match="refusing to serve plaintext on 0.0.0.0"):
        ServerConfig(model=str(tiny_target_dir), host="0.0.0.0")
    ServerConfig(model=str(tiny_target_dir), host="0.0.0.0", transport=TransportConfig(insecure=True))
    ServerConfig(model=str(tiny_target_dir), host="::1")
    # The edge never sends a token in plaintext off this machine (no connection is made).
    with pytest.raises(ValueError, match="refusing to send a token in plaintext to 192.0.2.1:50051"):
        open_channel("192.0.2.1:50051", ChannelSecurity(token="se_x"))


def test_every_rpc_needs_a_known_token(mtls_server, pki, tokens, fingerprint):
    fp = wire.fingerprint_to_proto(fingerprint)
    calls = {
        "Handshake": lambda stub: stub.Handshake(pb.HandshakeRequest(protocol_version=1, draft_tokenizer=fp)),
        "OpenSession": lambda stub: stub.OpenSession(pb.OpenSessionRequest(tokenizer=fp, prompt_token_ids=PROMPT)),
        "ContinueSession": lambda stub: stub.ContinueSession(pb.ContinueSessionRequest(session_id="x", token_ids=[5])),
        "Verify": lambda stub: stub.Verify(pb.VerifyRequest(session_id="x")),
        "CloseSession": lambda stub: stub.CloseSession(pb.CloseSessionRequest(session_id="x")),
        "Generate": lambda stub: stub.Generate(pb.GenerateRequest(tokenizer=fp, prompt_token_ids=PROMPT)).read(),
        "Attach": lambda stub: stub.Attach(pb.AttachRequest()).read(),
    }

    async def run():
        results = {}
        for case, token in [("missing", None), ("wrong", "se_" + "A" * 43), ("revoked-looking", tokens["alice"][:-1])]:
            edge = Edge(mtls_server.address, fp, edge_security(pki, token))
            for name, call in calls.items():
                results[case, name] = await status_of(call(edge.stub))
            # Junk bytes: still refused for the missing token first, not parsed.
            junk = edge.channel.unary_unary("/specedge.v1.SpecEdge/Verify")
            results[case, "junk"] = await status_of(junk(b"\xff\xff\xff"))
            await edge.channel.close()
        return results

    before = mtls_server.server.stats.snapshot()["requests_refused"].get("unauthenticated", 0)
    results = asyncio.run(run())
    for (case, name), (code, details) in results.items():
        assert code == UNAUTHENTICATED, (case, name, code, details)
        expected = "requires a token" if case == "missing" else "unknown or revoked token"
        assert expected in details, (case, name, details)
    refused = mtls_server.server.stats.snapshot()["requests_refused"]["unauthenticated"]
    assert refused - before == len(results)
    assert not mtls_server.server.engine.sessions


def test_one_identity_cannot_touch_another_identitys_session(mtls_server, pki, tokens, fingerprint, tiny_target_dir):
    fp = wire.fingerprint_to_proto(fingerprint)
    expected = greedy_decode(AutoModelForCausalLM.from_pretrained(tiny_target_dir), PROMPT, 12, {2})

    async def run():
        alice, alice_again, bob = (
            Edge(mtls_server.address, fp, edge_security(pki, tokens[name])) for name in ("alice", "alice", "bob")
        )
        bob_lease = bob.stub.Attach(pb.AttachRequest())
        opened = await alice.open(max_new_tokens=12)
        sid, tokens_so_far = opened.session_id, [opened.first_token_id]
        refused = {
            "verify": await status_of(bob.verify(sid, num_generated=1)),
            "close": await status_of(bob.close(sid)),
        }
        bob_lease.cancel()  # bob's connection lease ending must not close alice's session
        await asyncio.sleep(0.2)
        # Alice's session is bound to alice, not to her connection: a second connection may drive it.
        while True:
            edge = alice if len(tokens_so_far) % 2 else alice_again
            done = len(tokens_so_far)
            reply = await edge.verify(sid, expected[done : done + 2], num_generated=done)
            tokens_so_far += reply.token_ids
            if reply.finish_reason != pb.FINISH_REASON_NONE:
                break
        await alice_again.close(sid)
        return refused, tokens_so_far

    refused, generated = asyncio.run(run())
    for name, (code, details) in refused.items():
        assert code == DENIED and "belongs to another identity" in details, (name, code, details)
    assert generated == expected
    assert not mtls_server.server.engine.sessions


def test_edge_client_over_mutual_tls_with_a_token_is_lossless(
    mtls_server, pki, tokens, fingerprint, tiny_target_dir, tiny_draft_dir
):
    from specedge.edge_client.drafting.torch_drafter import TorchDrafter

    expected = greedy_decode(AutoModelForCausalLM.from_pretrained(tiny_target_dir), PROMPT, 20, {2})

    async def run():
        policy = SpeculationPolicy(num_draft=4, max_new_tokens=20)
        connection = ConnectionConfig(security=edge_security(pki, tokens["bob"]))
        async with EdgeClient(mtls_server.address, fingerprint, config=connection) as client:
            limits = client.server_info.limits
            return await generate(client, PROMPT, TorchDrafter(tiny_draft_dir), policy=policy), limits

    result, limits = asyncio.run(run())
    assert result.token_ids == expected and result.stats.accepted_tokens > 0
    assert limits.max_sessions == 6 and limits.max_sessions_per_identity == 6


def test_tls_refuses_the_wrong_certificates(mtls_server, tiny_target_dir, pki, tokens, fingerprint):
    """Only an edge that trusts the server's CA and holds a certificate from the edges' CA gets in."""
    fp = wire.fingerprint_to_proto(fingerprint)
    handshake = pb.HandshakeRequest(protocol_version=1, draft_tokenizer=fp)
    token = tokens["alice"]
    attempts = {
        "plaintext": ChannelSecurity(),
        "server CA unknown to the edge": edge_security(pki, token, ca="rogue_ca"),
        "no client certificate": ChannelSecurity(token=token, tls_ca=pki["server_ca"]),
        "client certificate from another CA": edge_security(pki, token, cert="rogue"),
        "all right": edge_security(pki, token),
    }
    tls_only = TransportConfig(tls_cert=pki["server_cert"], tls_key=pki["server_key"])

    async def try_all(address, cases):
        codes = {}
        for name, security in cases.items():
            channel = open_channel(address, security)
            codes[name] = (await status_of(specedge_stub(channel).Handshake(handshake, timeout=10)))[0]
            await channel.close()
        return codes

    codes = asyncio.run(try_all(mtls_server.address, attempts))
    ok, unavailable = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE
    assert codes == {name: ok if name == "all right" else unavailable for name in attempts}, codes

    # TLS without client certificates: the server's CA is enough (no token file: no token needed).
    with ServerThread(ServerConfig(model=str(tiny_target_dir), port=0, max_context=64, transport=tls_only)) as server:
        codes = asyncio.run(
            try_all(server.address, {"tls": ChannelSecurity(tls_ca=pki["server_ca"]), "plaintext": ChannelSecurity()})
        )
    assert codes == {"tls": ok, "plaintext": unavailable}


def specedge_stub(channel):
    from specedge.v1 import specedge_pb2_grpc

    return specedge_pb2_grpc.SpecEdgeStub(channel)


def test_tokens_rotate_and_revoke_without_a_restart(tiny_target_dir, tmp_path, fingerprint):
    (old, old_line), (new, new_line) = make_token("carol"), make_token("carol")
    token_file = tmp_path / "tokens"
    write_atomically(token_file, old_line + "\n")
    config = ServerConfig(model=str(tiny_target_dir), port=0, max_context=64, auth_tokens=str(token_file))
    fp = wire.fingerprint_to_proto(fingerprint)

    async def handshake(address, token):
        channel = open_channel(address, ChannelSecurity(token=token))  # plaintext on loopback: local credentials
        code, _ = await status_of(
            specedge_stub(channel).Handshake(pb.HandshakeRequest(protocol_version=1, draft_tokenizer=fp))
        )
        await channel.close()
        return code

    async def run(address):
        codes = [(await handshake(address, old), await handshake(address, new))]
        opened = await Edge(address, fp, ChannelSecurity(token=old)).open(max_new_tokens=8)
        write_atomically(token_file, f"{old_line}\n{new_line}\n")  # step 1: add the new token
        await asyncio.sleep(1.2)  # the server looks at the file at most once a second
        codes.append((await handshake(address, old), await handshake(address, new)))
        write_atomically(token_file, f"{new_line}\n")  # step 3: revoke the old one
        await asyncio.sleep(1.2)
        codes.append((await handshake(address, old), await handshake(address, new)))
        # Same identity, new token: the session opened with the old token goes on.
        reply = await Edge(address, fp, ChannelSecurity(token=new)).verify(opened.session_id, num_generated=1)
        write_atomically(token_file, "carol:not-a-hash\n")  # a broken edit: the last good file stays in force
        await asyncio.sleep(1.2)
        codes.append((await handshake(address, old), await handshake(address, new)))
        return codes, reply

    with ServerThread(config) as server:
        codes, reply = asyncio.run(run(server.address))
    ok = grpc.StatusCode.OK
    assert codes == [(ok, UNAUTHENTICATED), (ok, ok), (UNAUTHENTICATED, ok), (UNAUTHENTICATED, ok)]
    assert len(reply.token_ids) >= 1


def test_attach_streams_are_capped_per_identity_over_all_its_connections(tiny_target_dir, tokens, fingerprint):
    config = ServerConfig(
        model=str(tiny_target_dir), port=0, max_context=64, auth_tokens=tokens["file"], max_attach_per_identity=2
    )
    fp = wire.fingerprint_to_proto(fingerprint)

    async def run(address, limiter):
        alice = [Edge(address, fp, ChannelSecurity(token=tokens["alice"])) for _ in range(3)]  # three connections
        bob = Edge(address, fp, ChannelSecurity(token=tokens["bob"]))
        streams = [alice[0].stub.Attach(pb.AttachRequest()), alice[1].stub.Attach(pb.AttachRequest())]
        await until(lambda: limiter.held("alice") == 2)
        refused = alice[2].stub.Attach(pb.AttachRequest())  # a new connection of the same identity
        status = await refused.code(), await refused.details()
        streams.append(bob.stub.Attach(pb.AttachRequest()))
        await until(lambda: limiter.held("bob") == 1)
        assert not any(stream.done() for stream in streams)
        for stream in streams:
            stream.cancel()
        await until(lambda: limiter.num_held == 0)
        for edge in (*alice, bob):
            await edge.channel.close()
        return status

    with ServerThread(config) as server:
        assert server.server.service.limits.max_attach_streams_per_identity == 2
        code, details = asyncio.run(run(server.address, server.server.service.attach_limiter))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "already holds 2 Attach streams" in details, (code, details)


def test_edge_reports_a_refused_token_in_one_line(mtls_server, pki, fingerprint):
    async def run():
        async with EdgeClient(mtls_server.address, fingerprint, config=ConnectionConfig(edge_security(pki, "se_nope"))):
            pass

    started = time.monotonic()
    with pytest.raises(EdgeError, match="UNAUTHENTICATED: unknown or revoked token"):
        asyncio.run(run())
    assert time.monotonic() - started < 10


def test_the_command_lines_with_tls_and_a_token_from_the_environment(tiny_target_dir, tiny_draft_dir, pki, tokens):
    process, address = start_server_process(
        "--model",
        str(tiny_target_dir),
        "--max-context",
        "128",
        "--tls-cert",
        pki["server_cert"],
        "--tls-key",
        pki["server_key"],
        "--auth-tokens",
        tokens["file"],
    )
    edge = [
        os.path.join(os.path.dirname(sys.executable), "specedge-edge"),
        "--server",
        address,
        "--draft",
        str(tiny_draft_dir),
        "--prompt",
        "print(i * i)",
        "--max-tokens",
        "12",
        "--tls-ca",
        pki["server_ca"],
    ]
    try:
        answered = subprocess.run(
            [*edge, "--json"],
            env={**os.environ, "SPECEDGE_TOKEN": tokens["alice"]},
            capture_output=True,
            text=True,
            timeout=300,
        )
        refused = subprocess.run(
            edge, env={**os.environ, "SPECEDGE_TOKEN": ""}, capture_output=True, text=True, timeout=300
        )
    finally:
        process.kill()
        process.wait(timeout=30)
    assert answered.returncode == 0, answered.stderr
    assert len(json.loads(answered.stdout)["token_ids"]) == 12
    assert refused.returncode == 1
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("specedge-edge: server refused: UNAUTHENTICATED: this server requires a token"), line
