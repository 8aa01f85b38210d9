"""Chain drafts (greedy or sampled) from a GGUF model through llama.cpp (no torch needed).

Rolling back is nearly free: llama.cpp keeps the evaluated ids beside the KV
cache, and setting `Llama.n_tokens = keep` makes the next `eval` drop every
cache entry from `keep` on (it calls `kv_cache_seq_rm` first). So each round
costs only the tokens that are new since the last one.

Logits are read straight from llama.cpp's output buffer. With
`logits_all=False`, `Llama.eval` in llama-cpp-python 0.3.16 and 0.3.36 does not copy
logits into `Llama.scores` at all (that array stays uninitialised), and
`logits_all=True` would allocate n_ctx x vocab floats (1.2 GB for a Qwen
vocabulary at 2048). `llama_get_logits_ith(ctx, -1)` is the last evaluated
position's row, which is the only one a chain needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading
from collections.abc import Iterator, Sequence

import llama_cpp
import numpy as np

from specedge.edge_client.drafting.base import (
    ChainBuilder,
    CoupledSampling,
    DraftChain,
    DraftSampling,
    SparseDist,
    sample_top_k,
)
from specedge.edge_client.drafting.coupled import draw_coupled
from specedge.edge_client.llama_log import route_llama_logs_to_logging
from specedge.tokens import fingerprint_from_gguf

log = logging.getLogger(__name__)

# Where llama.cpp is built with AMX (recent Xeons), its AMX kernels are used only where they measured correct;
# elsewhere models load without them (and without the repacked layouts, which the same switch governs):
# - llama-cpp-python 0.3.16 (the pinned version) runs Q4_0 and Q4_1 weights through AMX kernels that return wrong
#   logits for batches of 32 and 64 tokens: SmolLM2-135M Q4_1's next-token probabilities moved by up to 0.64 and
#   its argmax changed (ggml-org/llama.cpp#16315). Its Q4_K kernels measured correct: on a 2-core Xeon the built-in
#   0.5B Q4_K_M drafts a token 1.10-1.15x faster with them, and scripts/demo.sh answers 1.11-1.16x faster.
# - 0.3.36 segfaults in the AMX product on every batch of two tokens or more, Q4_K_M and Q4_1 alike
#   (ggml-org/llama.cpp#20824, open upstream). Versions other than the pinned one are treated alike.
_AMX_CHECKED_VERSION = "0.3.16"
_AMX_MISCOMPUTED = frozenset({llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1})
_MODEL_PARAMS_LOCK = threading.Lock()


def _amx_in_build() -> bool:
    """Whether this llama.cpp build would put weights in its AMX buffers."""
    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def _amx_unchecked() -> str | None:
    """Why this llama.cpp build's AMX kernels must not run any model, or None: known before a model is loaded."""
    if not _amx_in_build() or llama_cpp.__version__ == _AMX_CHECKED_VERSION:
        return None
    return (
        f"llama.cpp's AMX kernels are checked only in llama-cpp-python {_AMX_CHECKED_VERSION}, not "
        f"{llama_cpp.__version__} (0.3.36's segfault on batches of two tokens or more: ggml-org/llama.cpp#20824)"
    )


def _amx_miscomputes(llm: llama_cpp.Llama) -> str | None:
    """Why the checked build's AMX kernels must not run this loaded model's weights, or None."""
    if not _amx_in_build():
        return None
    try:
        file_type = int(llm.metadata.get("general.file_type", -1))
    except ValueError:
        return None
    if file_type in _AMX_MISCOMPUTED:
        return "llama.cpp's AMX kernels miscompute Q4_0 and Q4_1 weights on this CPU (a Q4_K or Q8_0 GGUF keeps them)"
    return None


@contextlib.contextmanager
def _extra_buffer_types_off() -> Iterator[None]:
    """Models loaded inside keep their weights in plain CPU buffers: no AMX (nor repacked) layouts.
    `llama_cpp.Llama` takes no argument for llama.cpp's `use_extra_bufts`, so its defaults are swapped meanwhile."""
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def without_extra_buffer_types() -> llama_cpp.llama_model_params:
        params = defaults()
        params.use_extra_bufts = False
        return params

    with _MODEL_PARAMS_LOCK:
        llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffer_types
        try:
            yield
        finally:
            llama_cpp.llama_cpp.llama_model_default_params = defaults


class LlamaCppDrafter:
    """Drafter over one llama.cpp context; not safe to share between threads.

    `n_threads=None` uses every logical CPU: the edge machine is the user's,
    and without proactive drafting the drafter is idle while the server
    verifies. (llama-cpp-python's own default, half the CPUs, is one thread
    on a 2-core machine: about half the draft speed.)
    """

    def __init__(
        self,
        model_path: str | pathlib.Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_batch: int = 512,
    ):
        route_llama_logs_to_logging()

        def load() -> llama_cpp.Llama:
            return llama_cpp.Llama(
                model_path=str(model_path),
                n_ctx=n_ctx,
                n_threads=n_threads or os.cpu_count() or 1,
                n_batch=n_batch,
                logits_all=False,
                verbose=False,
            )

        # An unchecked build is known before loading; miscomputed weights only once the file type is read.
        hazard = _amx_unchecked()
        if hazard is None:
            llm = load()
            if hazard := _amx_miscomputes(llm):
                llm.close()
        if hazard:
            log.warning("%s: %s; drafting without them", pathlib.Path(model_path).name, hazard)
            with _extra_buffer_types_off():
                llm = load()
        self._llm: llama_cpp.Llama | None = llm
        self._num_vocab = llm.n_vocab()
        self._max_tokens = llm.n_ctx()
        self.fingerprint = fingerprint_from_gguf(model_path)

    def propose(
        self,
        context: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling | CoupledSampling | None = None,
        min_prob: float = 0.0,
    ) -> DraftChain:
        if len(context) == 0:
            raise ValueError("cannot draft from an empty context")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        llm = self._require_open()
        context_ids = np.asarray(context, dtype=np.intc)  # [num_context]
        # Context plus drafts must fit the KV cache; draft fewer rather than fail.
        num_tokens = min(num_tokens, self._max_tokens - len(context_ids))
        if num_tokens <= 0:
            return ChainBuilder(sampling).build()

        keep = self._reusable_prefix(context_ids)
        suffix = context_ids[keep:]
        if suffix.min() < 0 or suffix.max() >= self._num_vocab:
            raise ValueError(f"context holds token ids outside the draft vocabulary [0, {self._num_vocab})")
        llm.n_tokens = keep  # rollback: eval() drops the cache from here on
        llm.eval(suffix.tolist())

        chain = ChainBuilder(sampling)
        for step in range(num_tokens):
            logits = self._last_logits()  # [vocab]
            first, second = _top_two(logits)
            # On the position's confidence, before any draw: see Drafter.propose.
            if _softmax_prob(logits, first) < min_prob:
                break
            position = len(context_ids) + step  # the sequence index this draft token will occupy
            if sampling is None:
                token, dist = first, None
            elif isinstance(sampling, CoupledSampling):
                token, dist = draw_coupled(logits, sampling, position), None
            else:
                token, dist = self._sample_next(logits, sampling, position)
            prob = _softmax_prob(logits, token)
            runner_up = second if token == first else first
            chain.add(token, prob, dist, runner_up, _softmax_prob(logits, runner_up))
            # The last draft stays unevaluated: if it is accepted, the next
            # call evaluates it as part of that call's suffix.
            if step + 1 < num_tokens:
                llm.eval([token])
        return chain.build()

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    def _require_open(self) -> llama_cpp.Llama:
        if self._llm is None:
            raise RuntimeError("drafter is closed")
        return self._llm

    def _reusable_prefix(self, context_ids: np.ndarray) -> int:
        """How many leading context tokens already have their KV in the cache.

        At most len(context) - 1: the logits after the context's last token
        are needed, and llama.cpp keeps only the last evaluated row, so that
        token is always evaluated again. E.g. cache [5 8 9 4], context
        [5 8 9 4] -> keep 3; context [5 8 7] -> keep 2.
        """
        llm = self._require_open()
        cached = llm.input_ids[: llm.n_tokens]  # [num_cached]
        limit = min(len(cached), len(context_ids) - 1)
        mismatches = np.flatnonzero(cached[:limit] != context_ids[:limit])
        return int(mismatches[0]) if mismatches.size else limit

    def _last_logits(self) -> np.ndarray:
        """[vocab] logits after the last evaluated token: a view, valid until the next eval."""
        row = llama_cpp.llama_get_logits_ith(self._require_open().ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self._num_vocab,))

    def _sample_next(self, logits: np.ndarray, sampling: DraftSampling, position: int) -> tuple[int, SparseDist]:
        num_kept = min(sampling.top_k, self._num_vocab)
        top_ids = np.argpartition(logits, -num_kept)[-num_kept:]  # [num_kept], unordered
        return sample_top_k(top_ids.tolist(), logits[top_ids].tolist(), sampling, position)


def _top_two(logits: np.ndarray) -> tuple[int, int]:
    """The two largest logits' token ids, largest first."""
    pair = np.argpartition(logits, -2)[-2:]  # [2], unordered
    first, second = (int(pair[1]), int(pair[0])) if logits[pair[1]] >= logits[pair[0]] else (int(pair[0]), int(pair[1]))
    return first, second


def _softmax_prob(logits: np.ndarray, token: int) -> float:
    """softmax(logits)[token]: 1 / sum(exp(logits - logits[token])), no full softmax array needed."""
    return 1.0 / float(np.exp(logits - logits[token], dtype=np.float64).sum())
