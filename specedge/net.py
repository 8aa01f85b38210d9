"""Addresses: which ones stay on this machine (torch-free, shared by the server and the edge)."""

from __future__ import annotations

import ipaddress
import socket


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


def on_this_machine(address: str) -> bool:
    """Whether a gRPC target is served from this machine: loopback, or an address of one of its interfaces
    (one a socket can bind to), names resolved first. A name that does not resolve: no."""
    host = host_of(address)
    if is_loopback(host) or address.startswith("unix:"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])  # an IPv6 address may carry a "%zone"
        if ip.is_loopback or ip.is_unspecified:
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False
