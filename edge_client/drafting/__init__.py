"""Drafters: one module per drafting backend, all behind the `Drafter` Protocol.

`load_drafter` picks the backend by the resolved model's format. The imports
are deferred into the factories so that a GGUF-only edge never imports torch
or transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from specedge.edge_client.drafting.base import DraftChain, Drafter

if TYPE_CHECKING:
    from specedge.registry import ResolvedModel

__all__ = ["DraftChain", "Drafter", "load_drafter"]


def _load_llama_cpp(resolved: ResolvedModel, **options: Any) -> Drafter:
    from specedge.edge_client.drafting.llama_cpp import LlamaCppDrafter

    return LlamaCppDrafter(resolved.path, **options)


def _load_torch(resolved: ResolvedModel, **options: Any) -> Drafter:
    from specedge.edge_client.drafting.torch_drafter import TorchDrafter

    return TorchDrafter(resolved.path, **options)


_FACTORIES: Mapping[str, Callable[..., Drafter]] = {
    "gguf": _load_llama_cpp,
    "hf": _load_torch,
}


def load_drafter(resolved: ResolvedModel, **options: Any) -> Drafter:
    """A drafter for `resolved`; `options` go to the backend's constructor
    (LlamaCppDrafter: n_ctx, n_threads, n_batch; TorchDrafter: device, dtype)."""
    try:
        factory = _FACTORIES[resolved.format]
    except KeyError:
        raise ValueError(
            f"no drafter for model format {resolved.format!r} ({resolved.name}); known: {', '.join(_FACTORIES)}"
        ) from None
    return factory(resolved, **options)
