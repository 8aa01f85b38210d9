"""Shared fixtures: tiny models built once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # the desktop app's tests: real widgets, no display

from tiny_models import save_tiny_model  # noqa: E402  (tests/ is on pythonpath, see pyproject.toml)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_target_dir):
    """The target plus noise: accepts often but not always."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, noise_from=tiny_target_dir, noise=0.02)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=2, arch="llama", num_kv_heads=4)


# Llama 3.x's "llama3" RoPE frequencies, with an original context of 32 so that tests run past it.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """Qwen3: per-head q/k norms and a head_dim (32) that is not hidden / heads (16)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=4, arch="qwen3", head_dim=32)


@pytest.fixture(scope="session")
def tiny_qwen3_draft_dir(tmp_path_factory, tiny_qwen3_dir):
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-draft"),
        seed=5,
        arch="qwen3",
        head_dim=32,
        noise_from=tiny_qwen3_dir,
        noise=0.02,
    )


@pytest.fixture(scope="session")
def tiny_wide_head_dir(tmp_path_factory):
    """Heads of 128 values, as the 1.5B's: the numba attention's tiles take them (AVX-512), narrower ones the loops."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-wide-head"), seed=7, arch="qwen3", head_dim=128)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory):
    """Llama 3.x: llama3 RoPE scaling and tied embeddings, as in Llama-3.2-1B."""
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-llama3"),
        seed=6,
        arch="llama",
        tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE,
    )


@pytest.fixture(scope="session")
def tiny_foreign_dir(tmp_path_factory):
    """A model whose tokenizer differs from the target's: the handshake must refuse it."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-foreign"), seed=3, tokenizer_vocab_size=320, vocab_size=320)


@pytest.fixture(scope="module")
def tokenizer(tiny_draft_dir):
    """The tiny pair's tokenizer (a module may define its own)."""
    from specedge.edge_client.tokenizer import HFTokenizer

    return HFTokenizer(tiny_draft_dir)


@pytest.fixture(scope="module")
def drafter(tiny_draft_dir):
    """The tiny draft model, drafting in this process on the CPU."""
    from specedge.edge_client.drafting.torch_drafter import TorchDrafter

    drafter = TorchDrafter(tiny_draft_dir)
    yield drafter
    drafter.close()


@pytest.fixture(scope="session")
def reference_model(tiny_target_dir):
    """The tiny target through transformers itself: the oracle's model (see reference.py)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def server(request, tiny_target_dir):
    """One server on the tiny target for the whole module, shaped by the module's marker:

        pytestmark = pytest.mark.server_options(max_sessions=6, max_draft_tokens=16)

    Keywords: max_context (default 256); draft=True serves the tiny draft too (the server's own drafter);
    metrics_port; process=True runs `specedge-server` as a subprocess (a harness.ServerProcess, max_context
    only) instead of a harness.ServerThread; everything else is an EngineConfig field.
    """
    from harness import ServerProcess, tiny_server  # imports the server, torch included: not for every test module

    marker = request.node.get_closest_marker("server_options")
    options = dict(marker.kwargs) if marker is not None else {}
    if options.pop("draft", False):
        options["draft_model"] = request.getfixturevalue("tiny_draft_dir")
    as_process = options.pop("process", False)
    with (ServerProcess if as_process else tiny_server)(tiny_target_dir, **options) as running:
        yield running
