"""The edge's gRPC channel: plaintext, TLS, or mutual TLS, with an optional bearer token.

The token rides as `authorization: Bearer TOKEN` call credentials, which gRPC
sends only over a secure transport: TLS (`tls`, or `tls_ca` given), or, for a plaintext
server on this machine (loopback, e.g. through an SSH tunnel), gRPC's local
credentials, which refuse any address that is not loopback. A token never
crosses a network in the clear.
"""

from __future__ import annotations

import dataclasses
import os

import grpc

from specedge.net import host_of, is_loopback

TOKEN_ENV = "SPECEDGE_TOKEN"


@dataclasses.dataclass(frozen=True)
class ChannelSecurity:
    token: str | None = None  # bearer token from `specedge-server make-token`
    tls_ca: str | None = None  # PEM file of the CA that signed the server's certificate; given: TLS
    tls: bool = False  # TLS even without tls_ca: the server's certificate is checked against the system's CAs
    tls_cert: str | None = None  # PEM client certificate, for servers that require mutual TLS
    tls_key: str | None = None  # PEM private key of tls_cert

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate: give both, or neither")
        if self.tls_cert is not None and not self.uses_tls:
            raise ValueError("a client certificate is for TLS: give --tls-ca (or --tls) too")

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca is not None

    @classmethod
    def from_env(cls, token: str | None = None, **tls) -> ChannelSecurity:
        """`token`, else $SPECEDGE_TOKEN (an empty value counts as none)."""
        return cls(token=token or os.environ.get(TOKEN_ENV) or None, **tls)


def open_channel(
    address: str, security: ChannelSecurity = ChannelSecurity(), keepalive: tuple[float, float] | None = None
) -> grpc.aio.Channel:
    """A channel on its own TCP connection (the server binds tokenless sessions to the connection). `keepalive`:
    (interval, timeout) in seconds: ping the server that often, and give the connection up as dead when a ping goes
    unanswered that long, so that calls on a connection whose path died fail as lost (UNAVAILABLE) instead of
    waiting out their deadline."""
    options: list[tuple[str, int]] = [("grpc.use_local_subchannel_pool", 1)]
    if keepalive is not None:
        interval_ms, timeout_ms = (round(seconds * 1000) for seconds in keepalive)
        options += [
            ("grpc.keepalive_time_ms", interval_ms),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms),  # as the server's transport: arms the wait for the answer
            ("grpc.http2.max_pings_without_data", 0),  # an idle lease is still a connection to watch
        ]
    if not security.uses_tls and security.token is None:
        return grpc.aio.insecure_channel(address, options=options)
    if security.uses_tls:
        transport = grpc.ssl_channel_credentials(
            root_certificates=_read(security.tls_ca) if security.tls_ca else None,  # None: the system's CAs
            private_key=_read(security.tls_key) if security.tls_key else None,
            certificate_chain=_read(security.tls_cert) if security.tls_cert else None,
        )
    elif is_loopback(host_of(address)):
        transport = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    else:
        raise ValueError(
            f"refusing to send a token in plaintext to {address}: give --tls-ca (or --tls) for a TLS server "
            "(or reach a plaintext server through a loopback address, e.g. an SSH tunnel)"
        )
    if security.token is not None:
        transport = grpc.composite_channel_credentials(transport, grpc.access_token_call_credentials(security.token))
    return grpc.aio.secure_channel(address, transport, options=options)


def _read(path: str) -> bytes:
    with open(path, "rb") as pem:
        return pem.read()
