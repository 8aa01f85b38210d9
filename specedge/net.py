"""Addresses: which ones stay on this machine (torch-free, shared by the server and the edge)."""

from __future__ import annotations

import ipaddress


def host_of(address: str) -> str:
    """The host of a gRPC target: "127.0.0.1:50051" -> "127.0.0.1", "[::1]:50051" -> "::1"."""
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        address = address.removeprefix(scheme)
    if address.startswith("["):
        return address[1 : address.find("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def is_loopback(host: str) -> bool:
    """True only for addresses that cannot leave this machine; a host name other than localhost may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
