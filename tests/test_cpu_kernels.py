"""minipd's CPU kernels against the portable PyTorch paths they replace."""

import math

import pytest
import torch
import torch.nn.functional as F

from minipd.models import cpu_kernels, kernel_build
from minipd.models.attention import gather
from minipd.models.linear import Linear, use_cpu_kernels
from minipd.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.helpers import run_staggered

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels could not be built here")


def reference_attention(q, k_cache, v_cache, tables, lens, bs):
    pos = torch.arange(max(lens))
    slots = tables[:, pos // bs] * bs + pos % bs
    k, v = gather(k_cache, slots).transpose(1, 2), gather(v_cache, slots).transpose(1, 2)
    mask = (pos[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True).squeeze(2)


@pytest.mark.parametrize(
    "dtype,tol,d,hq",  # head_dim 64 or 128 takes the vector path (float32 or bfloat16); others the generic one
    [(torch.float32, 1e-5, 64, 9), (torch.float32, 1e-5, 128, 6), (torch.float32, 1e-5, 32, 9),
     (torch.bfloat16, 1e-2, 64, 9), (torch.bfloat16, 1e-2, 128, 6), (torch.bfloat16, 1e-2, 32, 9),
     # 5 to 8 query heads per kv head: the values' sums go several heads at a time (on AVX-512 up to 6
     # at head_dim 64 and 3 at 128), and the rest
     (torch.float32, 1e-5, 64, 15), (torch.float32, 1e-5, 128, 24), (torch.bfloat16, 1e-2, 64, 15),
     (torch.float32, 1e-5, 64, 24), (torch.float32, 1e-5, 64, 21), (torch.bfloat16, 1e-2, 64, 24),
     (torch.bfloat16, 1e-2, 64, 21), (torch.bfloat16, 1e-2, 128, 24)],
)  # fmt: skip
def test_paged_attention_equals_gathering_each_context(dtype, tol, d, hq):
    torch.manual_seed(0)
    bs, blocks, hkv = 16, 600, 3
    k_cache, v_cache = torch.randn(blocks * bs, hkv, d, dtype=dtype), torch.randn(blocks * bs, hkv, d, dtype=dtype)
    lens = [1, 17, 300, 1024, 2047, 64]
    perm, tables, used = torch.randperm(blocks), torch.zeros(len(lens), 128, dtype=torch.long), 0
    for i, n in enumerate(lens):  # scattered blocks, as after many requests came and went
        tables[i, : -(-n // bs)] = perm[used : used + -(-n // bs)]
        used += -(-n // bs)
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    got = torch.ops.minipd.paged_attention(q, k_cache, v_cache, tables, torch.arange(len(lens)),
                                           torch.tensor(lens) - 1, bs, 1 / math.sqrt(d))  # fmt: skip
    want = reference_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, bs)
    assert (got.float() - want).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,group", [(64, 3), (64, 8), (128, 3), (128, 8)])
def test_paged_attention_gives_a_head_the_same_bits_whether_it_shares_its_kv_head_or_not(dtype, d, group):
    # the query heads of one kv head may be taken together; each head's sums must be the ones it gets
    # alone (its kv head repeated for it: one query head per kv head), bit for bit
    torch.manual_seed(d + group)
    bs, blocks, hkv, lens = 16, 120, 2, [1, 17, 300, 64]
    k_cache, v_cache = torch.randn(blocks * bs, hkv, d, dtype=dtype), torch.randn(blocks * bs, hkv, d, dtype=dtype)
    tables = torch.randperm(blocks)[: 4 * 20].view(4, 20)
    q = torch.randn(len(lens), hkv * group, d, dtype=dtype)
    args = (tables, torch.arange(len(lens)), torch.tensor(lens) - 1, bs, d**-0.5)
    shared = torch.ops.minipd.paged_attention(q, k_cache, v_cache, *args)
    alone = torch.ops.minipd.paged_attention(q, k_cache.repeat_interleave(group, 1).contiguous(),
                                             v_cache.repeat_interleave(group, 1).contiguous(), *args)  # fmt: skip
    assert torch.equal(shared, alone)


@pytest.mark.parametrize("bs", [1, 8, 32])  # blocks smaller or larger than the lanes the kernel takes at once
def test_paged_attention_with_any_block_size(bs):
    torch.manual_seed(bs)
    lens, hkv, hq, d = [1, 5, 33, 250], 3, 9, 64
    blocks = sum(-(-n // bs) for n in lens) + 7
    k_cache, v_cache = torch.randn(blocks * bs, hkv, d), torch.randn(blocks * bs, hkv, d)
    tables, perm, used = torch.zeros(len(lens), -(-max(lens) // bs), dtype=torch.long), torch.randperm(blocks), 0
    for i, n in enumerate(lens):
        tables[i, : -(-n // bs)] = perm[used : used + -(-n // bs)]
        used += -(-n // bs)
    q = torch.randn(len(lens), hq, d)
    got = torch.ops.minipd.paged_attention(q, k_cache, v_cache, tables, torch.arange(len(lens)),
                                           torch.tensor(lens) - 1, bs, 1 / math.sqrt(d))  # fmt: skip
    torch.testing.assert_close(got, reference_attention(q, k_cache, v_cache, tables, lens, bs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_paged_attention_one_thread_reuses_its_buffers_over_tokens_of_any_length(dtype, tol):
    # one thread takes every token in turn (a long context, then shorter ones, a sequence twice);
    # head_dim 128, one query head per kv head, blocks of 8
    torch.manual_seed(1)
    bs, hkv, hq, d, lens, seq = 8, 2, 2, 128, [250, 33, 5, 1, 47], [0, 1, 2, 3, 0]
    k_cache, v_cache = torch.randn(200 * bs, hkv, d, dtype=dtype), torch.randn(200 * bs, hkv, d, dtype=dtype)
    tables = torch.randperm(200)[: 4 * 32].view(4, 32)[seq]
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = torch.ops.minipd.paged_attention(q, k_cache, v_cache, tables, torch.arange(len(lens)),
                                               torch.tensor(lens) - 1, bs, d**-0.5)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    want = reference_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, bs)
    assert (got.float() - want).abs().max() < tol


@pytest.mark.parametrize("d", [64, 128])
def test_paged_attention_in_bfloat16_is_float32_over_the_same_values_rounded_to_nearest_even(d):
    torch.manual_seed(d)
    bs, blocks, hkv, hq, lens = 16, 200, 3, 9, [1, 17, 300, 64]
    k_cache, v_cache = torch.randn(blocks * bs, hkv, d).bfloat16(), torch.randn(blocks * bs, hkv, d).bfloat16()
    tables = torch.randperm(blocks)[: 4 * 20].view(4, 20)
    q = torch.randn(len(lens), hq, d).bfloat16()
    args = (tables, torch.arange(len(lens)), torch.tensor(lens) - 1, bs, d**-0.5)
    got = torch.ops.minipd.paged_attention(q, k_cache, v_cache, *args)
    want = torch.ops.minipd.paged_attention(q.float(), k_cache.float(), v_cache.float(), *args)
    if cpu_kernels.kernel_isa() == "avx512" and cpu_kernels.bfloat16_dot():
        # the keys' dot products in vdpbf16ps: the same products (exact in float32), summed in pairs
        # and scaled after: at most one bfloat16 step from float32 rounded, and nearly always none
        step = want.abs() * 2**-7 + 1e-6
        assert ((got.float() - want).abs() <= step).all() and (got == want.bfloat16()).float().mean() > 0.97
    else:
        assert torch.equal(got, want.bfloat16())  # the same sums (widening is exact), one rounding, as torch rounds


# the kernels compute the same on every ISA they are built for (MINIPD_KERNEL_ISA=avx2 or scalar
# builds the others on x86); whether the engine uses them is the dispatch's choice, tested below


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", range(1, 9))
def test_small_linear_in_bfloat16_is_the_float32_product_of_the_same_values_rounded_once(rows, threads):
    torch.manual_seed(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((1537, 576), (64, 100), (3, 1536), (5, 1541), (700, 1541)):
            x, w, b = (torch.randn(rows, k) * 4).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
            for bias in (b, None):
                got = torch.ops.minipd.small_linear(x, w, bias)
                exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                # one rounding to bfloat16 (half an ulp, 2^-9 of the value) and float32 sums
                assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    finally:
        torch.set_num_threads(before)


def test_small_linear_multiplies_bfloat16_with_dot_product_instructions_where_built_for_a_cpu_with_them():
    flags, isa = kernel_build.cpu_flags(), cpu_kernels.kernel_isa()
    dot_flag = {"avx512": "avx512_bf16", "neon": "bf16"}.get(isa)  # x86 AVX512-BF16; ARM BF16 (BFDOT)
    built_for_this_cpu = kernel_build.forced_isa() is None  # -march=native
    assert cpu_kernels.bfloat16_dot() == (built_for_this_cpu and dot_flag in flags)


@pytest.mark.parametrize("threads", [1, 2])  # one thread calls the blocks directly, more split them
def test_blocked_linear_equals_f_linear_at_any_number_of_rows(threads):
    nb = cpu_kernels.block_columns()
    torch.manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:  # rows: none, each remainder of a block of rows, and past one pass's 128 rows
        for rows in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 17, 127, 128, 130, 300):  # blocks of 8 or 6 rows
            for n, k in ((nb, 1), (3 * nb, 577), (10 * nb, 64), (3 * nb, 0), (3 * nb, 2100)):  # K 0: the bias
                x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
                blocks = torch.ops.minipd.blocked_weight(w)
                assert blocks.shape == (n // nb, k, nb)
                atol = 1e-4 * max(1.0, k / 577)  # sums of k products: their rounding grows with k
                torch.testing.assert_close(torch.ops.minipd.blocked_linear(x, blocks, b), F.linear(x, w, b),
                                           rtol=1e-5, atol=atol)  # fmt: skip
                torch.testing.assert_close(torch.ops.minipd.blocked_linear(x, blocks, None), F.linear(x, w),
                                           rtol=1e-5, atol=atol)  # fmt: skip
        x = torch.randn(6, 2 * 64)[:, ::2]  # not contiguous
        w = torch.randn(nb, 64)
        torch.testing.assert_close(torch.ops.minipd.blocked_linear(x, torch.ops.minipd.blocked_weight(w), None), x @ w.T)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no kernels built")
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_linear_in_bfloat16_is_the_exact_product_within_bfloat16_rounding(threads):
    """vdpbf16ps (AVX512-BF16) adds each pair of products into a float32 sum; elsewhere the weights
    are widened in registers (a bfloat16 model on AVX2 ran its decode batches on small_linear and
    its prefills on weights widened for each call, slower than float32 at batch 8). Either way the
    result, rounded once to bfloat16, must lie within bfloat16's rounding of the exact product of
    the same values."""
    nb = cpu_kernels.block_columns()
    shapes = ((nb, 2), (3 * nb, 578)) + (() if cpu_kernels.blocked_bfloat16_dot() else ((2 * nb, 577),))
    torch.manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 130):
            for n, k in shapes:
                x, w, b = (torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16())
                got = torch.ops.minipd.blocked_linear(x, torch.ops.minipd.blocked_weight(w), b)
                exact = F.linear(x.double(), w.double(), b.double())
                assert got.dtype == torch.bfloat16 and got.shape == exact.shape
                assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-2).all()
    finally:
        torch.set_num_threads(before)


def test_blocked_linear_refuses_what_it_cannot_do():
    nb = cpu_kernels.block_columns()
    with pytest.raises(RuntimeError, match="multiple"):
        torch.ops.minipd.blocked_weight(torch.randn(nb + 1, 8))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.minipd.blocked_weight(torch.randn(nb, 8, dtype=torch.float16))
    if cpu_kernels.blocked_bfloat16_dot():
        with pytest.raises(RuntimeError, match="even"):
            torch.ops.minipd.blocked_weight(torch.randn(nb, 7, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="even"):  # blocks made by hand: K in pairs or not at all
            torch.ops.minipd.blocked_linear(torch.randn(2, 7).bfloat16(), torch.randn(1, 7, nb).bfloat16(), None)
    blocks = torch.ops.minipd.blocked_weight(torch.randn(nb, 8))
    with pytest.raises(RuntimeError, match="x \\(M, K\\)"):
        torch.ops.minipd.blocked_linear(torch.randn(2, 9), blocks, None)
    with pytest.raises(RuntimeError, match="blocked_weight"):
        torch.ops.minipd.blocked_linear(torch.randn(2, 8), torch.randn(nb, 8), None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.minipd.blocked_linear(torch.randn(2, 8), blocks, torch.randn(nb + 1))


@pytest.mark.parametrize("threads", [1, 2])  # one thread calls the rows directly, more split them
@pytest.mark.parametrize("rows", range(1, 9))  # each row count has its own register shape
def test_small_linear_equals_f_linear(rows, threads):
    torch.manual_seed(rows)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((1537, 576), (64, 100), (3, 1536), (5, 1541), (700, 1541)):  # odd sizes reach the tails (and K's tiles')
            x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
            assert torch.allclose(torch.ops.minipd.small_linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
            assert torch.allclose(torch.ops.minipd.small_linear(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "new,ctx,hq,hkv,d",
    [(1, 1, 9, 3, 64), (5, 5, 9, 3, 64), (7, 40, 9, 3, 64), (300, 300, 9, 3, 64), (129, 700, 9, 3, 64),
     (17, 17, 4, 4, 16), (13, 150, 8, 1, 128), (40, 90, 6, 2, 48), (20, 20, 2, 1, 192), (45, 1100, 9, 3, 64)],
)  # fmt: skip
def test_paged_prefill_equals_causal_attention_over_the_gathered_context(new, ctx, hq, hkv, d, threads):
    """`new` tokens at the end of a ctx-token context (a whole prompt, or a chunk after a cached prefix)."""
    torch.manual_seed(new * ctx)
    bs = 16
    blocks = -(-ctx // bs) + 5
    table = torch.randperm(blocks)[: -(-ctx // bs)]
    k_cache, v_cache = torch.randn(blocks * bs, hkv, d), torch.randn(blocks * bs, hkv, d)
    q = torch.randn(new, hq, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.minipd.paged_prefill(q, k_cache, v_cache, table, ctx, bs, d**-0.5)
    finally:
        torch.set_num_threads(before)
    pos = torch.arange(ctx)
    slots = table[pos // bs] * bs + pos % bs
    k, v = gather(k_cache, slots).transpose(0, 1)[None], gather(v_cache, slots).transpose(0, 1)[None]
    mask = pos[None, :] <= torch.arange(ctx - new, ctx)[:, None]
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
    assert (got - want[0].transpose(0, 1)).abs().max() < 1e-5


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 16), (6, 2, 48), (8, 1, 128), (2, 1, 256)])
@pytest.mark.parametrize("new,ctx", [(1, 1), (37, 37), (20, 300), (129, 200), (3, 513)])  # odd keys in a last pair
def test_paged_prefill_in_bfloat16_equals_float32_attention_over_the_same_values(new, ctx, hq, hkv, d):
    torch.manual_seed(ctx)
    bs = 16
    blocks = -(-ctx // bs) + 5
    table = torch.randperm(blocks)[: -(-ctx // bs)]
    k_cache, v_cache = torch.randn(blocks * bs, hkv, d).bfloat16(), torch.randn(blocks * bs, hkv, d).bfloat16()
    q = torch.randn(new, hq, d).bfloat16()
    got = torch.ops.minipd.paged_prefill(q, k_cache, v_cache, table, ctx, bs, d**-0.5)
    want = torch.ops.minipd.paged_prefill(q.float(), k_cache.float(), v_cache.float(), table, ctx, bs, d**-0.5)
    assert got.dtype == torch.bfloat16
    if not cpu_kernels.prefill_bfloat16_dot():
        assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()  # the float32 result, rounded once
    else:  # vdpbf16ps takes p * V with each p rounded to bfloat16 (2^-9 of p, so of sum p |v| / l at most)
        p_v = torch.ops.minipd.paged_prefill(q.float(), k_cache.float(), v_cache.float().abs(), table, ctx, bs, d**-0.5)
        assert ((got.float() - want).abs() <= (want.abs() + p_v) * 2**-8 + 1e-6).all()


def test_paged_prefill_refuses_what_it_cannot_do():
    q, cache, table = torch.randn(4, 2, 64), torch.randn(64, 1, 64), torch.arange(4)
    with pytest.raises(RuntimeError, match="block table too short"):
        torch.ops.minipd.paged_prefill(q, cache, cache, table[:1], 40, 16, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.minipd.paged_prefill(
            torch.randn(4, 2, 80), torch.randn(64, 1, 80), torch.randn(64, 1, 80), table, 4, 16, 0.1
        )
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.minipd.paged_prefill(q.bfloat16(), cache, cache, table, 4, 16, 0.125)


def test_the_engine_gives_the_same_tokens_with_and_without_the_kernels(tiny_model):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [[5 + i] * (3 + 40 * i) for i in range(5)]
    fast = make_engine(tiny_model)
    assert fast.runner.read_in_place
    assert fast.runner.prefill_in_place == cpu_kernels.small_linear_available()
    got = run_staggered(fast, prompts, params)
    portable = make_engine(tiny_model)
    portable.runner.read_in_place = portable.runner.prefill_in_place = False
    use_cpu_kernels(tiny_model, on=False)
    assert not any(getattr(m, "fused", False) or getattr(m, "small_rows", False) for m in tiny_model.modules())
    try:
        assert run_staggered(portable, prompts, params) == got
    finally:
        use_cpu_kernels(tiny_model)


def test_fused_elementwise_steps_equal_the_eager_ones():
    from minipd.models.rope import apply_rope

    torch.manual_seed(0)
    x, w = torch.randn(37, 576) * 3, torch.randn(576)
    eager = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert (torch.ops.minipd.rms_norm(x, w, 1e-5) - eager).abs().max() < 1e-5
    gate_up = torch.randn(37, 2 * 1539) * 6  # halves of one product: strided rows, an odd width reaches the tail
    gate, up = gate_up.split(1539, dim=-1)
    assert (torch.ops.minipd.silu_and_mul(gate, up) - F.silu(gate) * up).abs().max() < 1e-4
    qkv = torch.randn(37, (9 + 3 + 3) * 64)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(37, 9, 64), k.view(37, 3, 64)
    cos, sin = torch.randn(37, 1, 64), torch.randn(37, 1, 64)
    want_q, want_k = apply_rope(q, k, cos, sin)
    torch.ops.minipd.rope_(q, k, cos, sin)  # in place, through the views
    assert (q - want_q).abs().max() < 1e-5 and (k - want_k).abs().max() < 1e-5
    assert (qkv[:, : 9 * 64].view(37, 9, 64) - want_q).abs().max() < 1e-5
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.minipd.rms_norm(x.half(), w.half(), 1e-5)


def test_fused_elementwise_steps_in_bfloat16_round_as_the_eager_ones_do():
    from minipd.models.llama import RMSNorm
    from minipd.models.rope import apply_rope

    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).bfloat16()
    norm = RMSNorm(576, 1e-5).bfloat16()
    norm.weight.data = torch.randn(576).bfloat16()
    eager = norm(x)
    got = torch.ops.minipd.rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == torch.bfloat16 and (got.float() - eager.float()).abs().max() <= eager.float().abs().max() * 2**-7
    gate_up = (torch.randn(37, 2 * 1539) * 6).bfloat16()
    gate, up = gate_up.split(1539, dim=-1)
    eager = F.silu(gate) * up
    got = torch.ops.minipd.silu_and_mul(gate, up)
    # silu is rounded to bfloat16 before the product, as eager does; where float32 silu lies within an
    # ulp or two of a rounding midpoint (silu(5.9375) is 1.2 float32 ulps below one), the two may round
    # it apart by one bfloat16 ulp (2^-7 of the value at most) before the product's own rounding
    assert got.dtype == torch.bfloat16
    apart = got.float() != eager.float()
    assert ((got.float() - eager.float()).abs() <= eager.float().abs() * (2**-7 + 2**-8) + 1e-6).all()
    assert apart.float().mean() < 0.005, apart.float().mean()  # rare: near a midpoint only
    qkv = torch.randn(37, (9 + 3 + 3) * 64).bfloat16()
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(37, 9, 64), k.view(37, 3, 64)
    cos, sin = torch.randn(37, 1, 64).bfloat16(), torch.randn(37, 1, 64).bfloat16()
    want_q, want_k = apply_rope(q, k, cos, sin)
    exact_q, _ = apply_rope(q.double(), k.double(), cos.double(), sin.double())
    torch.ops.minipd.rope_(q, k, cos, sin)
    assert (q.double() - exact_q).abs().max() <= (want_q.double() - exact_q).abs().max()  # one rounding, not three
    assert (k.float() - want_k.float()).abs().max() < 0.1


@pytest.mark.parametrize("native", [False, True])
def test_a_bfloat16_model_reads_its_weights_in_the_small_row_kernel_and_widens_only_without_bf16_instructions(
    monkeypatch, native
):
    """Defect: bfloat16 took none of minipd's kernels, and on a CPU without bfloat16 instructions
    PyTorch's bfloat16 product ran 6x slower than float32 (oneDNN refuses it there)."""
    from minipd.models.linear import Linear
    from minipd.models.loader import load_model

    monkeypatch.setattr(cpu_kernels, "native_bfloat16", lambda: native)
    model = load_model("tiny-random", torch.bfloat16, "cpu")
    assert use_cpu_kernels(model) == cpu_kernels.small_linear_available()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    want_rows = cpu_kernels.SMALL_LINEAR_MAX_ROWS if cpu_kernels.small_linear_available() else 0
    assert all(m.small_rows == want_rows and m.packed is None and m.widen is not native for m in linears)
    assert all(m.fused == cpu_kernels.available() for m in model.modules() if hasattr(type(m), "fused"))
    torch.manual_seed(0)
    for rows in (1, 8, 9, 300):  # small-row kernel, then many rows (widened where no instructions)
        m = linears[0]
        x = torch.randn(rows, m.in_features).bfloat16()
        got = m(x)
        exact = F.linear(x.double(), m.weight.double(), None if m.bias is None else m.bias.double())
        assert got.dtype == torch.bfloat16
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-2).all()


@pytest.mark.parametrize("dtype,prepack", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                           (torch.bfloat16, True)])  # fmt: skip
@pytest.mark.parametrize("head_dim,qkv_bias,inter", [(16, False, 128), (64, True, 128),  # generic, vector attention
                                                     (16, False, 72)])  # gate_up 144 wide: not in blocks, beside ones that are
def test_decode_in_one_call_gives_the_layer_loops_logits_bit_for_bit(dtype, prepack, head_dim, qkv_bias, inter):
    """csrc/decode_layers.cpp runs every layer of a decode batch in one call: the same kernels in the
    same order as the layer loop, so each step's logits must be identical, at batches 1 to 3 (with
    prepack on AVX-512: on the column-blocked weights, at any batch, or up to the small-row kernel's
    rows where some layer's columns are not a multiple of a block's)."""
    import dataclasses

    from minipd.models.files import tiny_random_config
    from minipd.models.llama import LlamaForCausalLM

    if not cpu_kernels.small_linear_available():
        pytest.skip("the small-row linear is not in use here (a scalar build): no layer runs only minipd's kernels")
    if prepack and not (cpu_kernels.blocked_linear_in_use() and (dtype == torch.float32 or cpu_kernels.blocked_bfloat16())):
        pytest.skip("no column-blocked weights for this ISA and dtype: prepack changes nothing in the one call")
    cfg = dataclasses.replace(tiny_random_config(), head_dim=head_dim, qkv_bias=qkv_bias, intermediate_size=inter)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model = model.to(dtype).eval()
    prompts = [[5, 9, 200, 31, 7], [44, 3], list(range(100, 140))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def steps(one_call: bool, monkeypatch):
        engine = make_engine(model, dtype=str(dtype).removeprefix("torch."), kv_cache_tokens=1024, prepack=prepack)
        blocked = [m.blocked is not None for m in model.modules() if isinstance(m, Linear)]
        assert all(blocked) if prepack and 2 * inter % cpu_kernels.block_columns() == 0 else (any(blocked) == prepack and not all(blocked))
        rows.append(model.decode_rows)  # beside unblocked layers: as many as the small-row kernel takes there
        widened = dtype == torch.bfloat16 and not cpu_kernels.blocked_bfloat16_dot()  # MKL from 512 rows
        blocked_rows = cpu_kernels.blocked_linear_rows()  # every product, or a decode step's rows (measured)
        blocked_rows = min(blocked_rows, cpu_kernels.MKL_FROM_ROWS_WITHOUT_AVX512 - 1) if widened else blocked_rows
        assert rows[-1] == blocked_rows if all(blocked) else 2 <= rows[-1] <= cpu_kernels.SMALL_LINEAR_MAX_ROWS
        if not one_call:
            model.decode_rows = 0
        seen, calls, forward, op = [], [], model.forward, torch.ops.minipd.decode_layers
        model.forward = lambda ids, *a: seen.append((len(ids), forward(ids, *a))) or seen[-1][1]
        monkeypatch.setattr(torch.ops.minipd, "decode_layers", lambda x, *a: calls.append(len(x)) or op(x, *a))
        try:
            run_staggered(engine, prompts, params, join_every=2)
        finally:
            del model.forward
            monkeypatch.undo()
        return seen, calls

    rows = []
    with pytest.MonkeyPatch.context() as mp:
        (one, one_calls), (loop, loop_calls) = steps(True, mp), steps(False, mp)
    assert [n for n, _ in one] == [n for n, _ in loop]
    assert {b for b in (1, 2, 3) if b <= rows[0]} <= set(one_calls) and max(one_calls) <= rows[0]
    assert loop_calls == []  # the one call ran at batches 1-3 (or as many as it takes), the loop never
    for (_, a), (_, b) in zip(one, loop):
        assert torch.equal(a, b)


def test_int8_after_the_kernels_stops_the_one_call_decode():
    """Defect (review): the one-call decode was planned only by use_cpu_kernels, so int8 weights set
    after it would have been skipped (the call reads the float weights); quantize_int8 re-plans."""
    from minipd.models.linear import quantize_int8
    from minipd.models.loader import load_model

    model = load_model("tiny-random", torch.float32, "cpu")  # its own: int8 stays on the model
    use_cpu_kernels(model)
    if not cpu_kernels.small_linear_available():
        pytest.skip("the small-row linear is not in use here")
    assert model.decode_rows > 0
    quantize_int8(model)
    assert model.decode_rows == 0
    linears = [m for m in model.modules() if hasattr(m, "int8")]
    assert all(m.int8 is not None and m.blocked is None and m.packed is None for m in linears)  # no copy left unused
