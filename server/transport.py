"""The gRPC transport: TLS (optionally mutual), message and connection limits, and the plaintext rule.

Plaintext is served only on a loopback address unless `insecure` says the
operator knows a trusted network or proxy protects the port: tokens and
prompts must not cross a network in the clear by accident.
"""

from __future__ import annotations

import dataclasses

import grpc

from specedge import wire
from specedge.net import is_loopback


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    tls_cert: str | None = None  # PEM certificate chain the server presents
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle; given: edges must present a certificate it signed (mTLS)
    insecure: bool = False  # allow plaintext on a non-loopback address
    max_message_bytes: int = 1 << 20  # largest request or reply; larger is RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int = 1024  # calls in progress (Attach streams included); more is RESOURCE_EXHAUSTED
    idle_connection_timeout_s: float | None = 600.0  # close a connection with no call in progress; None: never
    keepalive_s: float = 20.0  # ping a connection with a call in progress this often (finds vanished peers)
    keepalive_timeout_s: float = 10.0  # a ping unanswered this long closes the connection (and frees its sessions)

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs TLS: give --tls-cert and --tls-key too")
        if self.max_message_bytes < 4096 or self.max_concurrent_rpcs < 1:
            raise ValueError("max message bytes must be >= 4096 and max concurrent RPCs >= 1")
        if self.keepalive_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("keepalive interval and timeout must be > 0")
        if self.idle_connection_timeout_s is not None and self.idle_connection_timeout_s <= 0:
            raise ValueError(f"idle connection timeout must be > 0, got {self.idle_connection_timeout_s}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def check_exposure(self, host: str) -> None:
        """Refuse plaintext on an address other machines can reach, unless `insecure` says so."""
        if not self.tls and not self.insecure and not is_loopback(host):
            raise ValueError(
                f"refusing to serve plaintext on {host}: tokens and prompts would cross the network in the clear. "
                "Give --tls-cert and --tls-key, or --insecure if a trusted network or TLS proxy protects this port"
            )

    def grpc_options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", round(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(self.keepalive_timeout_s * 1000)),
            # gRPC 1.85 arms the wait for a ping's answer only with this one set too (measured).
            ("grpc.http2.ping_timeout_ms", round(self.keepalive_timeout_s * 1000)),
            # An Attach stream sends no data for hours; pings must go on regardless (gRPC stops after 2 by default).
            ("grpc.http2.max_pings_without_data", 0),
            # Edges ping too (their keepalive finds a dead path from their side); gRPC's default takes a ping more
            # often than every 5 minutes without data as abuse.
            ("grpc.http2.min_ping_interval_without_data_ms", round(wire.MIN_PING_INTERVAL_S * 1000)),
        ]
        if self.idle_connection_timeout_s is not None:
            options.append(("grpc.max_connection_idle_ms", round(self.idle_connection_timeout_s * 1000)))
        return options

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        """Add the listening port (TLS or plaintext); returns the port bound, 0 if it could not be."""
        if self.tls_cert is None or self.tls_key is None:  # together, or neither (__post_init__)
            return server.add_insecure_port(address)
        client_ca = _read(self.tls_client_ca) if self.tls_client_ca is not None else None
        credentials = grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )
        return server.add_secure_port(address, credentials)


def _read(path: str) -> bytes:
    with open(path, "rb") as pem:
        return pem.read()
