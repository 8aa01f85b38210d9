"""The numba path's compiled decoder layer (server/layer_kernel.py) against the modules it stands in for.

On the numba path a step of up to numba_max_rows() tokens, every row short enough for
the attention kernel, runs each layer in one compiled call. It must give every row
the logits and the KV entries the modules give, on every supported family (qkv
bias or none, per-head q/k norms, a decoupled head_dim, llama3 RoPE), and steps it
cannot take must fall back to the modules.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from specedge.registry import ResolvedModel
from specedge.server import attention, layer_kernel, loading, matmul
from specedge.server.attention import NUMBA_MAX_NEW
from specedge.server.loading import load_target
from specedge.server.matmul import numba_max_rows
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner
from test_batched_forward import session_rounds

CPU = torch.device("cpu")
NUM_SLOTS, MAX_LEN = 8, 96  # 8: eight rows of NUMBA_MAX_NEW tokens pass the largest product limit
# Qwen2 (qkv bias), Llama 2-style (none; 4 KV heads), Qwen3 (q/k norms, head_dim 32 != hidden / heads), Llama 3.x
# (llama3 RoPE, tied embeddings), and Qwen3 with heads of 128 (the attention tiles' on AVX-512), there also through
# the forms of the kernel this process did not choose at start (plain rows for panels, loops for tiles, or back).
FAMILIES = ["tiny_target_dir", "tiny_llama_dir", "tiny_qwen3_dir", "tiny_llama3_dir", "tiny_wide_head_dir"]
OTHER_FORMS = "tiny_wide_head_dir, the other forms"


@pytest.fixture(scope="module", params=[*FAMILIES, OTHER_FORMS])
def model(request):
    name, _, other = request.param.partition(", ")
    model_dir = request.getfixturevalue(name)
    panels, tiles = matmul.panels_here(), attention.tiles_here()
    with pytest.MonkeyPatch.context() as patch:
        if other:
            kernel = attention.numba_kernel()
            assert kernel is not None
            if not kernel.AVX512:
                pytest.skip("the panels and the attention tiles are AVX-512 IR: elsewhere there is one form")
            panels, tiles = not panels, not tiles
            patch.setattr(matmul, "panels_here", lambda dtype=torch.float32: panels)
            patch.setattr(loading, "tiles_here", lambda: tiles)
        target = load_target(ResolvedModel("tiny", "hf", model_dir), device=CPU, dtype=torch.float32, matmul="numba")
    model = target.model
    assert model.attention == "numba" and model.compiled_layers is not None
    assert isinstance(model.lm_head, matmul.PanelLinear) == panels == model.compiled_layers.panels
    assert model.attention_tiles == tiles
    return model


@pytest.fixture
def calls(monkeypatch):
    """How many forwards ran the compiled layers."""
    counted = []
    run = layer_kernel.CompiledLayers.__call__

    def counting(self, *args, **kwargs):
        counted.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(layer_kernel.CompiledLayers, "__call__", counting)
    return counted


def _step(model, rows, *, compiled: bool) -> tuple[list[torch.Tensor], ModelRunner]:
    """The round's logits with every prefix cached first (prefixes by the modules), and the runner."""
    layers = model.compiled_layers
    runner = ModelRunner(model, KVCache(model, num_slots=NUM_SLOTS, max_len=MAX_LEN, device=CPU, dtype=torch.float32))
    model.compiled_layers = None
    try:
        runner.forward([ForwardRequest(r.slot, 0, tuple(prefix)) for prefix, r in rows])
        model.compiled_layers = layers if compiled else None
        return runner.forward([r for _, r in rows]), runner
    finally:
        model.compiled_layers = layers


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=session_rounds(max_new=NUMBA_MAX_NEW + 8))
def test_compiled_layers_give_every_row_what_the_modules_give(model, calls, rows):
    """Random mixes of decode tokens, chains and trees over random prefixes, rows past NUMBA_MAX_NEW tokens too (the
    kernel walks them in chunks; the modules take the row loop): the same logits and KV entries."""
    assume(sum(len(r.token_ids) for _, r in rows) <= numba_max_rows())
    before = len(calls)  # one fixture for all of hypothesis's examples
    want, modules = _step(model, rows, compiled=False)
    assert len(calls) == before
    got, compiled = _step(model, rows, compiled=True)
    assert len(calls) == before + 1
    for logits, reference in zip(got, want):
        torch.testing.assert_close(logits, reference, atol=2e-4, rtol=0)
    for caches, references in ((compiled.kv.k, modules.kv.k), (compiled.kv.v, modules.kv.v)):
        for cache, reference in zip(caches, references):
            torch.testing.assert_close(cache, reference, atol=1e-4, rtol=0)


def test_steps_the_compiled_layers_cannot_take_run_the_modules(model, calls, monkeypatch):
    """Over numba_max_rows() tokens (a prefill chunk), a row too long for the attention kernel (over NUMBA_MAX_NEW
    tokens and NUMBA_MAX_ROW_KEYS keys, here lowered to NUMBA_MAX_NEW), or the row-loop attention: each runs the
    modules, and gives what they give."""
    monkeypatch.setattr(attention, "NUMBA_MAX_ROW_KEYS", NUMBA_MAX_NEW)
    short = numba_max_rows() // NUMBA_MAX_NEW + 1  # rows the attention kernel takes, over the product's limit together
    assert short <= NUM_SLOTS
    too_many = [((5, slot), ForwardRequest(slot, 2, tuple(range(slot, slot + NUMBA_MAX_NEW)))) for slot in range(short)]
    too_long = [((5,), ForwardRequest(0, 1, tuple(range(10, 11 + NUMBA_MAX_NEW)))), ((6,), ForwardRequest(1, 1, (7,)))]
    for rows in (too_many, too_long):
        got, _ = _step(model, rows, compiled=True)
        want, _ = _step(model, rows, compiled=False)
        for logits, reference in zip(got, want):
            torch.testing.assert_close(logits, reference, atol=0, rtol=0)  # the same path: bit for bit
    model.attention = "rows"
    try:
        _step(model, [((5,), ForwardRequest(0, 1, (8,)))], compiled=True)
    finally:
        model.attention = "numba"
    assert not calls


@pytest.mark.parametrize(("matmul", "attention"), [("numba", "rows"), ("eager", "numba"), ("onednn", "numba")])
def test_only_the_numba_paths_together_compile_layers(tiny_target_dir, matmul, attention):
    """The compiled layer is the numba product and attention kernels with their glue: another path for either
    keeps the modules (and spends no start-up compiling it)."""
    resolved = ResolvedModel("tiny", "hf", tiny_target_dir)
    target = load_target(resolved, device=CPU, dtype=torch.float32, matmul=matmul, attention=attention)
    assert (target.matmul, target.model.attention) == (matmul, attention)
    assert target.model.compiled_layers is None


def test_a_tokens_logits_do_not_depend_on_the_step_it_rides_in(model, calls):
    """On the compiled path a token's logits have the same bits whether it is decoded a step at a time, verified in
    a row of several tokens, decoded beside seven other rows, or verified beside a prefill chunk. The products sum
    every row alike (from one row a step on every CPU), attention walks each query's keys in the same blocks
    whatever the row's length, and a step with a long row runs compiled too. So where steps run this path, greedy
    verification accepts exactly the tokens server-only decoding picks, not only up to near ties. The token is
    decoded beside two rows, alone (a token a step: the server-only baseline at N = 1), in one row, in two, beside
    seven rows and beside a prefill chunk."""
    torch.manual_seed(1)
    vocab = model.lm_head.out_features
    prompt, new = torch.randint(vocab, (11,)).tolist(), torch.randint(vocab, (8,)).tolist()
    others = [torch.randint(vocab, (13 + len(new),)).tolist() for _ in range(7)]
    runner = ModelRunner(model, KVCache(model, num_slots=13, max_len=MAX_LEN, device=CPU, dtype=torch.float32))

    def prefill(slot, ids):
        runner.forward([ForwardRequest(slot, 0, tuple(ids), all_logits=False)])

    def decoded_beside(slot, neighbours):
        """new, a token a step in `slot`, each step with one token of each neighbour's row."""
        out = []
        for i, token in enumerate(new):
            step = [ForwardRequest(slot, len(prompt) + i, (token,))]
            step += [ForwardRequest(s, 13 + i, (others[s - 5][13 + i],)) for s in neighbours]
            out.append(runner.forward(step)[0][0])
        return torch.stack(out)

    for slot in range(5):
        prefill(slot, prompt)
    for slot in range(5, 12):
        prefill(slot, others[slot - 5][:13])
    before = len(calls)
    alone = decoded_beside(0, [5, 6])  # three tokens a step
    in_a_row = runner.forward([ForwardRequest(1, len(prompt), tuple(new))])[0]
    in_two = [
        runner.forward([ForwardRequest(2, len(prompt) + start, tuple(new[start:end]))])[0]
        for start, end in ((0, 5), (5, 8))
    ]
    for slot in range(5, 12):  # the neighbours again from the same point, for slot 3 to decode beside seven
        prefill(slot, others[slot - 5][:13])
    beside_seven = decoded_beside(3, range(5, 12))
    beside_a_prefill = runner.forward(  # beside a prefill chunk longer than NUMBA_MAX_NEW, and two decode rows
        [ForwardRequest(4, len(prompt), tuple(new)), ForwardRequest(5, 0, tuple(others[0][:20]), all_logits=False)]
        + [ForwardRequest(s, 13 + len(new), (others[s - 5][-1],)) for s in (6, 7)]
    )[0]
    assert len(calls) == before + 2 * len(new) + 4 + 7  # every step ran the compiled layers, the prefills too
    for got in (in_a_row, torch.cat(in_two), beside_seven, beside_a_prefill):
        assert torch.equal(got, alone)
    prefill(12, prompt)
    assert torch.equal(decoded_beside(12, []), alone)
