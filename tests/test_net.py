"""Which server addresses are this machine's (the edge turns proactive drafting off for them)."""

from __future__ import annotations

import socket

import pytest

from specedge.edge_client.cli import parse_args, runtime_config
from specedge.net import on_this_machine


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "localhost:50051", "[::1]:50051", "0.0.0.0:50051"])
def test_loopback_and_unspecified_addresses_are_this_machine(address):
    assert on_this_machine(address)


def test_this_machines_own_name_is_this_machine():
    assert on_this_machine(f"{socket.gethostname()}:50051")


@pytest.mark.parametrize("address", ["203.0.113.7:50051", "[2001:db8::1]:50051", "no-such-host.invalid:50051"])
def test_other_machines_and_unresolvable_names_are_not(address):
    # 203.0.113.0/24 and 2001:db8::/32 are documentation ranges: no interface here holds them.
    assert not on_this_machine(address)


@pytest.mark.parametrize(
    ("argv", "proactive"),
    [
        (["--prompt", "x", "--server", "127.0.0.1:50051"], False),  # shares the cores the verify runs on
        (["--prompt", "x"], False),  # the default server is this machine
        (["--prompt", "x", "--server", "203.0.113.7:50051"], True),
        (["--prompt", "x", "--server", "127.0.0.1:50051", "--proactive"], True),
        (["--prompt", "x", "--server", "203.0.113.7:50051", "--no-proactive"], False),
    ],
)
def test_proactive_drafting_defaults_off_only_for_a_server_on_this_machine(argv, proactive):
    assert runtime_config(parse_args(argv)).policy.proactive is proactive
