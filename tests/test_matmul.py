"""The matrix-product paths (server/matmul.py): what each computes, what it keeps in memory, and which one runs."""

from __future__ import annotations

import concurrent.futures
import logging
import re

import pytest
import torch
from torch import nn

from bench.engine import _proc_status
from specedge.registry import ResolvedModel
from specedge.server import heap, matmul
from specedge.server.kernels import kernel_array
from specedge.server.loading import load_target
from specedge.server.matmul import (
    PackedLinear,
    PairPanelLinear,
    PanelEmbedding,
    PanelLinear,
    PlainLinear,
    layout_rows,
    numba_max_rows,
    pair_panels,
    resolve_matmul,
)
from specedge.server.runner import ForwardRequest, KVCache, ModelRunner

CPU = torch.device("cpu")


@pytest.mark.parametrize("bias", [True, False])
# partial blocks of 4 and of 3 rows; 774: stripes of three and four blocks, so spans of two and of one (_SPAN)
@pytest.mark.parametrize("out_features", [4, 6, 7, 130, 774])
# 44: no prefetching tile; 528: K in chunks of 256 and 16; 2080 (Zen 4, 16 rows on): in chunks of 2048 and 32
@pytest.mark.parametrize("in_features", [48, 44, 528, 2080])
def test_plain_linear_equals_the_linear_it_replaces(in_features, out_features, bias):
    torch.manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    plain = PlainLinear(linear.weight, linear.bias)
    # Every row count mod 2 and mod 3 (the kernel pairs rows, and from three rows on prefetches in passes of two to
    # three x rows, AVX-512: two to six), both sides of the kernel's limit, and a 3-d input.
    limit = numba_max_rows()
    _assert_computes(plain, linear, (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 23, 29, limit, limit + 1, 97))


def _assert_computes(module: torch.nn.Module, linear: torch.nn.Linear, row_counts: tuple[int, ...]) -> None:
    """`module` gives `linear`'s float32 products at each row count, and over a 3-d input."""
    with torch.inference_mode():
        for rows in row_counts:
            x = torch.randn(rows, linear.in_features)
            torch.testing.assert_close(module(x), linear(x), atol=1e-5, rtol=1e-5)
        x = torch.randn(2, 5, linear.in_features)
        torch.testing.assert_close(module(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [9, 130, 131, 774])  # ragged: partial blocks of 4 rows and of 3; 774 as above
@pytest.mark.parametrize("in_features", [96, 2080])  # 2080 (Zen 4, 16 rows on): K in chunks of 2048 and 32
def test_a_rows_products_do_not_depend_on_how_many_rows_share_them(in_features, out_features, dtype):
    """Every x row's products have the same bits at every row count the kernel's tiles take (from one row on every
    CPU), up to its limit; so on that path a token's products do not depend on the other tokens of its step. The
    last rows past the tiles' blocks are no exception."""
    _forward_numba = pytest.importorskip("specedge.server._forward_numba")  # numba's compiler
    if dtype == torch.bfloat16 and not _forward_numba.DPBF16:
        pytest.skip("bfloat16 products need AVX512_BF16")

    torch.manual_seed(in_features + out_features)
    plain = PlainLinear(torch.randn(out_features, in_features, dtype=dtype), None)
    first, limit = _forward_numba._PREFETCH_FROM, numba_max_rows(dtype)
    x = torch.randn(limit, in_features, dtype=dtype)
    with torch.inference_mode():
        alone = torch.cat([plain(x[m : m + first]) for m in range(0, limit - first + 1, first)])
        for rows in range(first, limit + 1):
            seen = min(rows, len(alone))
            assert torch.equal(plain(x[:rows])[:seen], alone[:seen]), rows


def _panels(dtype: torch.dtype = torch.float32):
    """The kernel module where its panel product runs for `dtype` (AVX-512: float32's default on every CPU but Zen
    4, bfloat16's without AMX, and elsewhere what `specedge-bench engine` times against the plain kernel), else
    skip."""
    kernel = matmul.panel_kernel(dtype)
    if kernel is None:
        pytest.skip("panels are the AVX-512 kernel's layout")
    return kernel


PANEL_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [5, 64, 130, 774])  # within one panel, one exactly, partial last panels
@pytest.mark.parametrize("in_features", [1, 67, 2100])  # K within a chunk, past one, in two parts at 128 rows
def test_panel_linear_equals_the_linear_it_replaces(in_features, out_features, bias, dtype, monkeypatch):
    """float32: the Linear's products. bfloat16: the exact sum of the exact products, rounded once to bfloat16
    (the weights and x widen exactly; the float32 sums round far below bfloat16's step), so a column stored out
    of its place in the panels' bfloat16 order shows. The weights pack five panels at a time (774 columns: three
    blocks and a partial panel)."""
    kernel = _panels(dtype)
    monkeypatch.setattr(matmul, "PACK_PANELS", 5)
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    panel = PanelLinear(linear.weight, linear.bias)
    assert panel.panels.shape == (-(-out_features // kernel.PANEL), in_features, kernel.PANEL)
    assert panel.panels.dtype == dtype
    # One tile (1-6 rows), two or three (7-18), more (x packed), a block of 128 and past it (two walks over the
    # weights).
    rows = (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 18, 19, 40, 56, 128, 129, 300)
    if dtype == torch.float32:
        _assert_computes(panel, linear, rows)
        return
    weight = linear.weight.double()
    bias_values = 0.0 if linear.bias is None else linear.bias.double()
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, dtype=dtype)
            y = panel(x)
            assert y.dtype == dtype
            exact = (x.double() @ weight.T + bias_values).to(dtype).double()
            torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=2**-7)


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
@pytest.mark.parametrize("out_features", [130, 774])
@pytest.mark.parametrize("in_features", [67, 2100])
def test_a_rows_panel_products_do_not_depend_on_how_many_rows_share_them(in_features, out_features, dtype):
    """Each value is one sum over K in order, so every row's products have the same bits at every row count: in
    any tile, with any number of tiles, x packed or not, K in one part or two, in any of several walks over the
    weights. bfloat16's too (its chunks and prefetches differ from float32's)."""
    _panels(dtype)
    torch.manual_seed(in_features + out_features)
    panel = PanelLinear(torch.randn(out_features, in_features, dtype=dtype), None)
    x = torch.randn(300, in_features, dtype=dtype)
    with torch.inference_mode():
        alone = torch.cat([panel(x[m : m + 1]) for m in range(len(x))])
        for rows in (*range(2, 57), 127, 128, 129, 135, 300):
            assert torch.equal(panel(x[:rows]), alone[:rows]), rows
            assert torch.equal(panel(x[len(x) - rows :]), alone[len(x) - rows :]), rows


@pytest.mark.parametrize("dtype", PANEL_DTYPES)
def test_a_tied_embedding_reads_the_heads_panels(dtype):
    _panels(dtype)
    torch.manual_seed(0)
    table = torch.randn(130, 24, dtype=dtype)
    embedding = PanelEmbedding(PanelLinear(table, None))
    token_ids = torch.tensor([[0, 63, 64, 129], [5, 5, 128, 1], [16, 17, 31, 32]])
    assert torch.equal(embedding(token_ids), torch.nn.functional.embedding(token_ids, table))


def _pairs():
    """The kernel module where `--matmul onednn-numba` runs (AVX512_BF16 without AMX, oneDNN's pair layout), else
    skip."""
    if reason := matmul.pairs_unavailable(CPU, torch.bfloat16):
        pytest.skip(reason)
    return matmul.pairs_kernel()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [5, 64, 130, 774])  # within one panel, one exactly, partial last panels
@pytest.mark.parametrize("in_features", [32, 96, 2080])  # K within a chunk of pairs, past one, in two parts at 128
def test_pair_panel_linear_reads_onednns_layout_and_rounds_once(in_features, out_features, bias, monkeypatch):
    """The kernel over oneDNN's packed bytes up to MAX_ROWS_PAIRS rows, oneDNN's GEMM above: either way the exact
    sum of the exact products rounded to bfloat16, within float32's rounding of the sum. The check of the layout
    walks five panels at a time (774 columns: three blocks and a partial panel)."""
    kernel = _pairs()
    monkeypatch.setattr(matmul, "PACK_PANELS", 5)
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    pairs = PairPanelLinear(linear.weight, linear.bias)
    assert pairs.panels is not None
    assert pairs.panels.shape == (-(-out_features // kernel.PANEL), in_features // 2, kernel.PANEL)
    weight = linear.weight.double()
    bias_values = 0.0 if linear.bias is None else linear.bias.double()
    rows = (1, 2, 5, 6, 7, 8, 13, 19, kernel.MAX_ROWS_PAIRS, kernel.MAX_ROWS_PAIRS + 1, 129)
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, in_features, dtype=torch.bfloat16)
            y = pairs(x)
            assert y.dtype == torch.bfloat16
            exact = (x.double() @ weight.T + bias_values).to(torch.bfloat16).double()
            torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=2**-7)
        x = torch.randn(2, 5, in_features, dtype=torch.bfloat16)
        torch.testing.assert_close(pairs(x).double(), (x.double() @ weight.T + bias_values), atol=1e-2, rtol=2**-7)


def test_a_rows_pair_products_do_not_depend_on_how_many_rows_share_them():
    """Up to MAX_ROWS_PAIRS rows, each value is one sum over K in order: the same bits at every row count."""
    kernel = _pairs()
    torch.manual_seed(1)
    pairs = PairPanelLinear(torch.randn(774, 2080).to(torch.bfloat16), None)
    x = torch.randn(kernel.MAX_ROWS_PAIRS, 2080).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([pairs(x[m : m + 1]) for m in range(len(x))])
        for rows in range(2, kernel.MAX_ROWS_PAIRS + 1):
            assert torch.equal(pairs(x[:rows]), alone[:rows]), rows
            assert torch.equal(pairs(x[len(x) - rows :]), alone[len(x) - rows :]), rows


def test_pair_panels_are_read_only_where_every_weight_is_in_its_place():
    """A weight one bit away from the packed one, or a K that oneDNN pads, leaves the projection on oneDNN alone,
    which still computes it."""
    _pairs()
    torch.manual_seed(2)
    weight = torch.randn(130, 96).to(torch.bfloat16)
    packed = PackedLinear(weight, None).packed
    assert pair_panels(packed, weight) is not None
    for row, column in ((0, 0), (129, 95), (70, 33)):  # the first panel, the partial last one, one in between
        other = weight.clone()
        other.view(torch.int16)[row, column] ^= 1
        assert pair_panels(packed, other) is None, (row, column)
    with pytest.raises(RuntimeError), torch.inference_mode():  # float32 x is never read as pairs; oneDNN refuses it
        PairPanelLinear(weight, None)(torch.randn(2, 96))
    odd = torch.randn(130, 100).to(torch.bfloat16)  # K not a multiple of 32: oneDNN pads it
    padded = PairPanelLinear(odd, None)
    assert padded.panels is None
    x = torch.randn(3, 100).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(padded(x), PackedLinear(odd, None)(x))


def test_a_tied_embedding_reads_the_heads_pairs():
    _pairs()
    torch.manual_seed(0)
    table = torch.randn(130, 64).to(torch.bfloat16)
    embedding = PanelEmbedding(PairPanelLinear(table, None))
    token_ids = torch.tensor([[0, 63, 64, 129], [5, 5, 128, 1], [16, 17, 31, 32]])
    assert torch.equal(embedding(token_ids), torch.nn.functional.embedding(token_ids, table))


def test_onednn_numba_path_keeps_one_copy_and_computes_the_onednn_paths_logits(tiny_llama3_dir):
    """Every projection packed once, read by both; the tied table held once, as the head's pairs; the logits those
    of `--matmul onednn` within bfloat16's rounding, and the same argmax."""
    _pairs()
    resolved = ResolvedModel("tiny", "hf", tiny_llama3_dir)
    onednn = load_target(resolved, device=CPU, dtype=torch.bfloat16, matmul="onednn").model
    target = load_target(resolved, device=CPU, dtype=torch.bfloat16, matmul="onednn-numba")
    model = target.model
    assert target.matmul == "onednn-numba"
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head, PairPanelLinear) and head.panels is not None
    assert isinstance(embedding, PanelEmbedding) and embedding.panels.data_ptr() == head.panels.data_ptr()
    for layer in model.model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        assert all(
            isinstance(m, PairPanelLinear) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        )
        assert attn.qkv_proj.panels is not None
    assert sum(p.numel() for name, p in model.named_parameters() if "norm" not in name) == 0
    token_ids = torch.arange(model.args.vocab_size)
    assert torch.equal(embedding(token_ids), onednn.model.embed_tokens(token_ids))
    step = [ForwardRequest(0, 0, (3, 17, 5, 9, 12))]
    logits = []
    for each in (onednn, model):
        runner = ModelRunner(each, KVCache(each, num_slots=1, max_len=16, device=CPU, dtype=torch.bfloat16))
        logits.append(runner.forward(step)[0].float())
    torch.testing.assert_close(logits[1], logits[0], atol=0.05, rtol=0.05)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))


@pytest.mark.parametrize("out_features", [7, 130])  # partial blocks of 4 and of 3 rows
@pytest.mark.parametrize("in_features", [48, 96, 1056])  # 48: no tile (K not a multiple of 32); 1056: K in chunks
def test_plain_linear_in_bfloat16_sums_in_float32_and_rounds_once(in_features, out_features):
    _forward_numba = pytest.importorskip("specedge.server._forward_numba")  # numba's compiler
    if not _forward_numba.DPBF16 or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("bfloat16 products need AVX512_BF16")
    assert matmul.numba_unavailable(CPU, torch.bfloat16) is None  # a kernel that fails its warm-up fails here
    torch.manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features, dtype=torch.bfloat16)
    plain = PlainLinear(linear.weight, linear.bias)
    weight, bias = linear.weight.double(), linear.bias.double()
    limit = numba_max_rows(torch.bfloat16)
    for rows in (1, 2, 3, 5, 6, 7, 8, 11, 16, 23, limit, limit + 1):
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        with torch.inference_mode():
            y = plain(x)
        assert y.dtype == torch.bfloat16
        exact = x.double() @ weight.T + bias  # bfloat16 products are exact in float32; only the sums round
        if rows <= limit:  # the kernel's own: within a rounding of bfloat16 of the exact sum
            torch.testing.assert_close(y.double(), exact.to(torch.bfloat16).double(), atol=1e-5, rtol=2**-7)
        else:  # oneDNN's GEMM on the same plain weight
            torch.testing.assert_close(y.double(), exact, atol=2e-2, rtol=2e-2)
    # The kernel itself at the rows other CPUs give it (Zen 4 up to 64; with AMX oneDNN takes them from 9 on): its
    # float32 sums, before the one rounding.
    kernel = matmul.numba_kernel()
    for rows in (9, 16, 23, 40, 64):
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        y = torch.empty(rows, out_features)
        kernel.matmul(kernel_array(x), kernel_array(linear.weight.detach()), y.numpy())
        torch.testing.assert_close(y.double(), x.double() @ weight.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_the_linear_it_replaces_in_either_layout(dtype):
    if matmul.onednn_unavailable(CPU, dtype) is not None:
        pytest.skip(matmul.onednn_unavailable(CPU, dtype))
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 130, dtype=dtype)
    # The default layout: 16 rows for bfloat16 and on AVX-512, else 1; both layouts must compute the same product.
    assert layout_rows(dtype) == (
        16 if dtype == torch.bfloat16 or "AVX512" in torch.backends.cpu.get_cpu_capability() else 1
    )
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for layout in (None, 1, 16):
        packed = PackedLinear(linear.weight, linear.bias, rows=layout)
        for rows in (1, 5, 16, 40, 97):
            x = torch.randn(rows, 96, dtype=dtype)
            with torch.inference_mode():
                torch.testing.assert_close(packed(x), linear(x), **tolerance)


def test_the_compiled_layers_x_rows_start_on_cache_lines():
    """numba's own arrays start 32 bytes into a cache line, where every AVX-512 load of an x row would straddle
    two lines; the compiled layer's scratch for the products' x rows starts on one (server/_forward_numba.py)."""
    kernel = matmul.numba_kernel()
    if kernel is None:
        pytest.skip("numba is not installed here")
    for num, width in ((1, 1536), (6, 1536), (8, 2048), (40, 1536), (40, 8960)):
        rows = kernel._lined_rows(num, width)
        assert rows.shape == (num, width) and rows.flags.c_contiguous
        assert rows.ctypes.data % 64 == 0


def test_numba_path_keeps_one_copy_of_the_weights(tiny_llama3_dir):
    """Fused q/k/v and gate/up replace the separate weights; a tied embedding and LM head share one table: on
    AVX-512 the head's panels, which the embedding reads, elsewhere the embedding's rows, which the head reads."""
    eager = load_target(ResolvedModel("tiny", "hf", tiny_llama3_dir), device=CPU, dtype=torch.float32).model
    target = load_target(ResolvedModel("tiny", "hf", tiny_llama3_dir), device=CPU, dtype=torch.float32, matmul="numba")
    model = target.model
    assert target.matmul == "numba"
    kind = PanelLinear if matmul.panels_here() else PlainLinear
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head, kind)
    if kind is PanelLinear:  # the fixture ties them
        assert isinstance(embedding, PanelEmbedding) and embedding.panels.data_ptr() == head.panels.data_ptr()
        assert (
            sum(p.numel() for p in model.parameters())
            == sum(p.numel() for name, p in eager.named_parameters() if "layers." in name and "norm" in name)
            + model.model.norm.weight.numel()
        )  # every projection and the table left the parameters for panels
    else:
        assert head.weight.data_ptr() == embedding.weight.data_ptr()
    token_ids = torch.arange(eager.args.vocab_size)
    assert torch.equal(embedding(token_ids), eager.model.embed_tokens(token_ids))
    for layer in model.model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj is None and attn.k_proj is None and attn.v_proj is None
        assert mlp.gate_proj is None and mlp.up_proj is None
        assert all(isinstance(m, kind) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))


def test_auto_chooses_by_device_and_dtype_and_names_what_cannot_run():
    assert resolve_matmul("auto", CPU, torch.float32) == "numba"
    assert resolve_matmul("eager", CPU, torch.float32) == "eager"
    assert resolve_matmul("onednn", CPU, torch.float32) == "onednn"
    # bfloat16 goes to numba where its panels run (a Xeon without AMX), else to oneDNN where this CPU has its
    # bfloat16 kernels (its packed layout is faster from 8 x 5 on than the plain rows); numba takes bfloat16 only
    # with AVX512_BF16.
    bf16 = "onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "eager"
    if matmul.pairs_unavailable(CPU, torch.bfloat16) is None:  # Zen 4: oneDNN's layout, read by the kernel too
        bf16 = "onednn-numba"
    if matmul.numba_unavailable(CPU, torch.bfloat16) is None and matmul.panels_here(torch.bfloat16):
        bf16 = "numba"
    assert resolve_matmul("auto", CPU, torch.bfloat16) == bf16
    with pytest.raises(ValueError, match="--matmul onednn-numba cannot run: it reads oneDNN's bfloat16 layout"):
        resolve_matmul("onednn-numba", CPU, torch.float32)
    if (reason := matmul.numba_unavailable(CPU, torch.bfloat16)) is None:
        assert resolve_matmul("numba", CPU, torch.bfloat16) == "numba"
    else:
        assert "AVX512_BF16" in reason or "bfloat16 instructions" in reason
        with pytest.raises(ValueError, match=f"--matmul numba cannot run: {re.escape(reason)}"):
            resolve_matmul("numba", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="--matmul numba cannot run: the numba kernel takes float32 or bfloat16"):
        resolve_matmul("numba", CPU, torch.float16)
    with pytest.raises(ValueError, match="--matmul numba cannot run: the numba kernel is for CPUs; cuda"):
        resolve_matmul("numba", torch.device("cuda"), torch.float32)
    assert resolve_matmul("auto", torch.device("cuda"), torch.float32) == "fused"
    assert resolve_matmul("auto", torch.device("cuda"), torch.bfloat16) == "fused"
    assert resolve_matmul("fused", CPU, torch.float32) == "fused"
    with pytest.raises(ValueError, match="unknown matmul path 'fast'"):
        resolve_matmul("fast", CPU, torch.float32)


def test_fused_projections_compute_the_separate_ones_in_one_copy(tiny_llama3_dir, tiny_target_dir):
    """CUDA's path: q/k/v (with Qwen2's biases) and gate/up stacked into one nn.Linear each, the separate weights
    gone, a tied head still the embedding's memory; the logits those of the separate products."""
    fused = load_target(ResolvedModel("tiny", "hf", tiny_llama3_dir), device=CPU, dtype=torch.float32, matmul="fused")
    assert fused.matmul == "fused" and fused.model.model.layers[0].self_attn.qkv_proj is not None
    for model_dir in (tiny_llama3_dir, tiny_target_dir):
        model = load_target(ResolvedModel("tiny", "hf", model_dir), device=CPU, dtype=torch.float32).model
        torch.manual_seed(0)
        with torch.no_grad():
            for name, bias in model.named_parameters():
                if name.endswith("bias"):  # a checkpoint's are trained; a fresh tiny model's are zeros
                    bias.normal_()
        runner = ModelRunner(model, KVCache(model, num_slots=1, max_len=16, device=CPU, dtype=torch.float32))
        step = [ForwardRequest(0, 0, (3, 17, 5, 9, 12))]
        want = runner.forward(step)[0]
        weight_bytes = sum(p.nbytes for p in model.parameters())
        matmul.fuse_projections(model)
        assert sum(p.nbytes for p in model.parameters()) == weight_bytes  # one copy, each counted once
        for layer in model.model.decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            assert attn.q_proj is None and attn.k_proj is None and attn.v_proj is None
            assert mlp.gate_proj is None and mlp.up_proj is None
            assert isinstance(attn.qkv_proj, torch.nn.Linear) and isinstance(mlp.gate_up_proj, torch.nn.Linear)
            assert (attn.qkv_proj.bias is not None) == model.args.qkv_bias
        if model.args.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        torch.testing.assert_close(runner.forward(step)[0], want, atol=1e-5, rtol=1e-5)


def test_without_the_kernel_auto_falls_back_to_onednn(monkeypatch, caplog):
    monkeypatch.setattr(matmul, "numba_kernel", lambda: None)  # numba missing, or failing to compile
    assert resolve_matmul("auto", CPU, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="--matmul numba cannot run: numba is missing or could not compile"):
        resolve_matmul("numba", CPU, torch.float32)
    monkeypatch.setattr(matmul, "onednn_unavailable", lambda device, dtype: "this torch build has no oneDNN")
    with caplog.at_level(logging.INFO, logger="specedge.server.matmul"):
        assert resolve_matmul("auto", CPU, torch.float32) == "eager"
    [line] = [record.getMessage() for record in caplog.records]
    assert line == (
        "matrix products run eager: numba: numba is missing or could not compile its kernel (logged above); "
        "onednn: this torch build has no oneDNN"
    )


def _private_bytes() -> int:
    anon = _proc_status()["RssAnon"]
    assert anon is not None
    return anon


@pytest.mark.skipif(heap._malloc_trim() is None, reason="malloc_trim is glibc's")
def test_freed_blocks_kept_by_the_heap_go_back_to_the_system():
    """What a load frees under glibc's raised mmap threshold stays private memory until return_freed_memory."""
    torch.empty(30 * 2**20, dtype=torch.uint8)  # a 30 MB map, freed at once: glibc's mmap threshold rises to 30 MB
    blocks = [torch.ones(4 * 2**20, dtype=torch.uint8) for _ in range(64)]  # 256 MiB of the heap, touched
    del blocks[:-1]  # the last one holds the heap's top: free() alone trims nothing
    before = _private_bytes()
    assert heap.return_freed_memory()
    assert before - _private_bytes() > 200 * 2**20


@pytest.mark.skipif(heap._malloc_trim() is None, reason="malloc_trim is glibc's")
def test_owning_the_weights_keeps_no_second_copy_in_the_heap():
    """transformers loads tensors on worker threads, so their blocks lie in those threads' arenas, which the loading
    thread's copies never reuse: without a trim as each original goes, the copies pile up beside them."""
    torch.empty(30 * 2**20, dtype=torch.uint8)  # a 30 MB map, freed at once: glibc's mmap threshold rises to 30 MB
    model = nn.Module()

    def load() -> torch.Tensor:
        model.weights = nn.ParameterList(nn.Parameter(torch.ones(2**19 + 1024 * i)) for i in range(48))  # 2-2.2 MB
        return torch.ones(2**20)  # the arena's top, held: the arena cannot shrink by itself

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        top = pool.submit(load).result()
    size = sum(p.nbytes for p in model.parameters())  # 104 MB
    before = _private_bytes()
    matmul._own_memory(model)
    assert _private_bytes() - before < size / 4 and top.numel() == 2**20
