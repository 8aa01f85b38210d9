"""What the connection bar says: where the app connects, which server it chose, and why one refused it.

gRPC reports a refused TLS handshake as an unreachable server (UNAVAILABLE,
the TLS library's words in the details), and the server's own refusals name
the command line's flags. A user of the window needs neither: `refusal` turns
them into a sentence about the window's own settings, and says None for a
server that is simply not there (the worker then retries with backoff).
"""

from __future__ import annotations

from specedge.edge_client.client import ConnectionLost, EdgeError
from specedge.edge_client.desktop.settings import ChatSettings

# Fragments of gRPC's details for a TLS handshake that failed (as grpcio 1.85 words them), first match
# wins, and what the user can do about each.
TLS_FAILURES = [
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS: turn Use TLS off"),
    ("certificate has expired", "the server's certificate has expired: tell its operator"),
    ("CERTIFICATE_VERIFY_FAILED", "the server's certificate is not signed by {ca}: choose the CA file that signed it"),
    ("Hostname Verification Check failed", "the server's certificate is for another name than the address used"),
]


def refusal(exc: EdgeError, settings: ChatSettings) -> str | None:
    """Plain words for a refusal the user must fix in the settings; None when the server is just unreachable."""
    details = str(exc)
    if isinstance(exc, ConnectionLost):
        for fragment, words in TLS_FAILURES:
            if fragment in details:
                ca = "the CA file you chose" if settings.tls_ca else "a CA this system trusts"
                return words.format(ca=ca)
        # The TCP connection opened and the server hung up during the handshake: a TLS server
        # refusing plaintext, or a mutual-TLS server refusing the client certificate (or its absence).
        if "Socket closed" in details:
            if not settings.use_tls:
                return "the server closed the connection at once: it probably requires TLS: turn Use TLS on"
            if not settings.tls_cert:
                return "the server closed the TLS connection: it probably requires a client certificate (mutual TLS)"
            return "the server closed the TLS connection: it does not accept your client certificate"
        return None
    if exc.status == "UNAUTHENTICATED":
        if "requires a token" in details:
            return "the server needs an access token: enter the one its operator made for you"
        return "the server does not accept this access token (unknown or revoked): ask its operator for a current one"
    if exc.status == "PERMISSION_DENIED":
        return f"the server does not allow this: {details.split(': ', 2)[-1]}"
    return None


def connecting(settings: ChatSettings) -> str:
    if settings.fleet_broker:
        fallback = f", falling back to {settings.server}" if settings.server else ""
        return f"choosing a server through the fleet broker {settings.fleet_broker}{fallback}"
    return f"connecting to {settings.server}"


def connected(runtime) -> str:
    """The server's model and where it runs; with a fleet broker, which announced server that is, or why none."""
    address = runtime.client.address
    words = f"{runtime.model_name} at {address}"
    router = runtime.router
    if router is not None:
        chosen = [server_id for server_id, seen in router.view.servers.items() if seen.message.address == address]
        if chosen:
            words += f" (fleet server {chosen[0]})"
        elif router.broker_down is not None:
            words += f" (the fallback: the fleet broker is unreachable, {router.broker_down})"
        else:
            words += " (the fallback: no compatible server on the fleet broker)"
    if runtime.draft_unavailable:
        words += f" (server-only: {runtime.draft_unavailable})"
    return words
