"""The server under test: `specedge-server` in its own process (as deployed), and its /metrics."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Sequence

from specedge.bench.lifeline import dying_with_parent


class ServerFailed(RuntimeError):
    """The server did not start; the message carries its last log lines."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--model", M, ...]) as server:` -> server.address, server.scrape().

    With `pin_cpus`, the server (and its torch threads) is confined to those CPUs.
    """

    def __init__(self, args: Sequence[str], *, pin_cpus: set[int] | None = None, timeout_s: float = 900):
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._args = [*args, "--port", str(self.port), "--metrics-port", str(self.metrics_port)]
        self._pin_cpus = pin_cpus
        self._timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._log: list[str] = []

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "OMP_NUM_THREADS": str(len(self._pin_cpus))} if self._pin_cpus else None
        binary = os.path.join(os.path.dirname(sys.executable), "specedge-server")
        self._process = subprocess.Popen(
            dying_with_parent([binary, *self._args, "--log-level", "WARNING"], cpus=self._pin_cpus),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready = threading.Event()

        output = self._process.stdout
        assert output is not None, "stdout=PIPE"

        def read() -> None:  # keep draining its output, so a chatty server never blocks on a full pipe
            for line in output:
                self._log.append(line.rstrip())
                del self._log[:-50]
                if line.startswith("specedge-server ready on"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(0.5):
            if self._process.poll() is not None:
                raise ServerFailed(f"specedge-server exited before it was ready: {self._last_lines()}")
            self._timeout_s -= 0.5
            if self._timeout_s <= 0:
                self._process.kill()
                raise ServerFailed(f"specedge-server was not ready in time: {self._last_lines()}")
        return self

    def __exit__(self, *exc_info) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()

    def _last_lines(self) -> str:
        return " | ".join(self._log[-5:]) or "no output"

    def scrape_cost_points(self) -> list[tuple[float, float]]:
        """The server's measured forward cost per token-count bucket: (tokens, seconds), by tokens."""
        text = self._metrics_text()
        return sorted((float(t), float(s)) for t, s in _COST_POINT.findall(text))

    def scrape(self) -> ServerCounters:
        return ServerCounters.parse(self._metrics_text())

    def _metrics_text(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).read().decode()


_METRICS = {
    "forward_s": "specedge:forward_seconds_sum",
    "schedule_s": "specedge:schedule_seconds_sum",
    "postprocess_s": "specedge:postprocess_seconds_sum",
    "steps": "specedge:engine_steps_total",
    "rows": "specedge:batch_size_sum",
    "batch_tokens": "specedge:batch_tokens_sum",
    "generated": "specedge:generation_tokens_total",
    "drafts": "specedge:spec_decode_num_drafts_total",
    "draft_tokens": "specedge:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "specedge:spec_decode_num_accepted_tokens_total",
    "holds": "specedge:step_holds_total",
    "hold_s": "specedge:step_hold_seconds_total",
    "hold_misses": "specedge:step_hold_misses_total",
}
_COST_POINT = re.compile(r'^specedge:step_cost_seconds\{tokens="([0-9.]+)"\} (\S+)$', re.M)
_PER_POS = re.compile(r'^specedge:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$', re.M)


@dataclasses.dataclass(frozen=True)
class ServerCounters:
    """The server's cumulative counters at one moment; subtract two to get a cell's share."""

    values: dict[str, float]
    accepted_per_pos: dict[int, float]  # rounds whose draft at this 0-based depth was accepted

    @classmethod
    def parse(cls, text: str) -> ServerCounters:
        values = {}
        for key, name in _METRICS.items():
            match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
            if match is None:
                raise ValueError(f"the server's /metrics has no {name}; is it a SpecEdge server of this version?")
            values[key] = float(match.group(1))
        return cls(values, {int(pos): float(count) for pos, count in _PER_POS.findall(text)})

    def __sub__(self, before: ServerCounters) -> ServerCounters:
        positions = set(self.accepted_per_pos) | set(before.accepted_per_pos)
        return ServerCounters(
            {key: value - before.values[key] for key, value in self.values.items()},
            {p: self.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0) for p in positions},
        )

    @property
    def busy_s(self) -> float:
        """Engine step time: planning, forwards (server-side drafting included), verification and commit."""
        return self.values["forward_s"] + self.values["schedule_s"] + self.values["postprocess_s"]
