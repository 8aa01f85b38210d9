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


@pytest.fixture(scope="session")
def tiny_foreign_dir(tmp_path_factory):
    """A model whose tokenizer differs from the target's: the handshake must refuse it."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-foreign"), seed=3, tokenizer_vocab_size=320, vocab_size=320)


@pytest.fixture(scope="session")
def reference_model(tiny_target_dir):
    """The tiny target through transformers itself: the oracle's model (see reference.py)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir)
