"""A real mosquitto broker on a loopback port, for the fleet tests.

Debian's `mosquitto` package (scripts/ensure-mosquitto.sh installs it);
where it is missing the tests that need it are skipped, saying why.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from harness import free_port
from specedge.bench.lifeline import dying_with_parent


def mosquitto_binary() -> str | None:
    # Debian installs it in /usr/sbin, which is not on every user's PATH.
    return shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")


class Broker:
    """`with Broker(tmp_path) as broker:` runs mosquitto on broker.url until the block ends."""

    def __init__(self, directory, *, users: dict[str, str] | None = None, tls: tuple[str, str] | None = None):
        binary = mosquitto_binary()
        if binary is None:
            pytest.skip("mosquitto is not installed (run scripts/ensure-mosquitto.sh, or apt-get install mosquitto)")
        self.binary, self.directory, self.port = binary, directory, free_port()
        lines = [f"listener {self.port} 127.0.0.1", "persistence false", "log_type error", "log_type warning"]
        # Running as root, mosquitto drops to the `mosquitto` user before reading these files; stay root instead.
        if os.geteuid() == 0:
            lines.append("user root")
        if users:
            password_file = directory / "passwords"
            password_file.write_text("".join(f"{name}:{password}\n" for name, password in users.items()))
            subprocess.run(
                [shutil.which("mosquitto_passwd") or "mosquitto_passwd", "-U", str(password_file)], check=True
            )
            lines += ["allow_anonymous false", f"password_file {password_file}"]
        else:
            lines.append("allow_anonymous true")
        if tls:
            cert, key = tls
            lines += [f"certfile {cert}", f"keyfile {key}"]
        self.config_file = directory / f"mosquitto-{self.port}.conf"
        self.config_file.write_text("\n".join(lines) + "\n")
        self.url = f"{'mqtts' if tls else 'mqtt'}://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Broker:
        self.process = subprocess.Popen(
            dying_with_parent([self.binary, "-c", str(self.config_file)]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mosquitto exited: {self.process.stderr.read()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mosquitto did not start listening")

    def __exit__(self, *exc_info) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def make_certificate(directory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (its own CA), via the openssl command line."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = directory / "broker.pem", directory / "broker.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)
