"""A step is billed until its device has run it. On CUDA a forward returns once its kernels are queued, so the
cost curve, the step budget and `forward_ms` must wait for them; an error they raise shows only then.

This machine has no GPU, so the runner below looks like a GPU's to the host: its forward returns at once, and
its work "finishes" in torch.cuda.synchronize, replaced by a sleep (or a raise). tests/test_cuda.py runs the
real thing on a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from specedge.registry import ResolvedModel
from specedge.server.loading import load_target
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner
from specedge.server.stats import ServerStats
from specedge.server.step import Stepper

KERNELS_S = 0.05  # what the queued kernels of one forward take


class QueuedRunner:
    """The tiny target's runner, reporting a CUDA device."""

    def __init__(self, inner: ModelRunner):
        self.inner, self.model, self.kv = inner, inner.model, inner.kv
        self.device = torch.device("cuda", 0)

    def forward_packed(self, requests):
        return self.inner.forward_packed(requests)

    def forward(self, requests):
        return self.inner.forward(requests)

    def move_kv(self, moves):
        self.inner.move_kv(moves)


@pytest.fixture
def stepper(tiny_target_dir) -> Stepper:
    cpu = torch.device("cpu")
    model = load_target(ResolvedModel("tiny", "hf", tiny_target_dir), device=cpu, dtype=torch.float32).model
    kv = KVCache(model, num_slots=2, max_len=128, device=cpu, dtype=torch.float32)
    return Stepper(QueuedRunner(ModelRunner(model, kv)), ServerStats(), max_batch_tokens=128)


def test_the_cost_curve_counts_the_kernels_not_their_launch(stepper, monkeypatch):
    waited_on = []

    def synchronize(device=None):
        waited_on.append(device)
        time.sleep(KERNELS_S)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    stepper.calibrate(max_tokens=128)
    points = stepper.cost_model.points()
    assert len(points) >= 2
    assert all(seconds >= KERNELS_S for _, seconds in points), points
    assert set(waited_on) == {torch.device("cuda", 0)}


def test_an_error_the_kernels_raise_fails_the_forward_not_the_engine(stepper, monkeypatch):
    """A device-side failure surfaces at the wait, inside the forward's isolation: the row gets it."""

    def synchronize(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    logits, failures = stepper._forward([ForwardRequest(0, 0, (5, 6, 7))])
    assert logits is None
    assert [str(f) for f in failures] == ["CUDA error: an illegal memory access was encountered"]
