"""Property-based fuzzing of every op in torch.ops.indexcache against reference.py.

Hypothesis draws shapes (0 and 1 rows, windows of 0, 1, k-1, k, k+1 keys and the buffer's
full width), strided and offset views where an op takes them, every dtype an op accepts,
block tables with repeated and out-of-order blocks, -1 holes and all -1 rows, ties, -0,
magnitudes near the fp8 / bf16 / fp32 limits, and NaN / +-inf (docs/ops.md, "Non-finite
inputs"). Every example checks the DESIGN.md §8 bar, that two calls are bit-identical, and
that every output element was written (outputs are poisoned with a NaN payload no kernel
makes). Invalid inputs must raise the op's own error and leave outputs untouched.

    python -m pytest -q tests/test_fuzz.py                              # CI profile
    python -m pytest -q tests/test_fuzz.py --hypothesis-profile=long    # thousands per op
    python -m pytest -q tests/test_fuzz.py -m slow                      # 256K-key rows
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import indexcache._C as _C
from indexcache import ops
from indexcache import reference as ref

from bitwise import bits, nan_equal
from test_ops import POISON_I, rel_err

POISON_F32_BITS = 0x7F8DEAD1  # a signalling NaN: no kernel produces this payload
POISON_BF16_BITS = 0x7F81
POISON_U8 = 0xA5
NONFINITE = [math.nan, -math.nan, math.inf, -math.inf]


# ------------------------------------------------------------------ helpers

def poisoned(shape, dtype):
    if dtype == torch.float32:
        return torch.full(shape, POISON_F32_BITS, dtype=torch.int32).view(torch.float32)
    if dtype == torch.bfloat16:
        return torch.full(shape, POISON_BF16_BITS, dtype=torch.int16).view(torch.bfloat16)
    return torch.full(shape, POISON_I, dtype=dtype)


def assert_written(t):
    """No element still holds the poison."""
    b = bits(t)
    poison = {torch.int32: POISON_F32_BITS if t.dtype == torch.float32 else POISON_I,
              torch.int16: POISON_BF16_BITS - 0x10000 if POISON_BF16_BITS > 0x7FFF else POISON_BF16_BITS}[b.dtype]
    assert not (b == poison).any(), "an output element was not written"


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def set_isa(isa):
    _C._set_cpu_isa(isa)


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    _C._set_cpu_isa("auto")


# Every CPU path this CPU runs: the default and each available one by name (_cpu_paths() says
# which a CPU lacks and why: no AVX-512 BF16, or a torch brgemm that refuses bf16).
isas = st.sampled_from(["auto"] + [name for name, why in _C._cpu_paths().items() if not why])


def sprinkle(draw, x, where_ok=True):
    """Maybe put NaN / +-inf at a few random flat positions of x (in place); returns x."""
    if not where_ok or x.numel() == 0 or not draw(st.booleans()):
        return x
    flat = x.view(-1) if x.is_contiguous() else None
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, x.numel() - 1))
        v = draw(st.sampled_from(NONFINITE))
        if flat is not None:
            flat[i] = v
        else:
            x.reshape(-1)[i] = v  # pragma: no cover
    return x


def magnitude(draw, lo=-40, hi=40):
    return 2.0 ** draw(st.integers(lo, hi))


def rand(shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


seeds = st.integers(0, 2**31 - 1)


def cmp_float(got, expect, bar, abs_scale=None):
    """Same NaN / +inf / -inf pattern; finite entries within a relative-norm bar."""
    got, expect = got.float(), expect.float()
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pred(got), pred(expect)), f"{pred.__name__} pattern differs"
    fin = torch.isfinite(expect)
    if fin.any():
        err = (got[fin].double() - expect[fin].double()).norm().item()
        ref_norm = expect[fin].double().norm().item()
        slack = 0.0 if abs_scale is None else abs_scale[fin].double().norm().item() * bar * 0.1
        assert err <= bar * ref_norm + slack + 1e-30, (err, ref_norm, slack)


# ------------------------------------------------------------------ fp8 quantization

@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_quantize_fp8(data, seed, isa):
    set_isa(isa)
    draw = data.draw
    lead = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
    d = 128 * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    hadamard = draw(st.booleans())
    eps = draw(st.sampled_from([ref.INDEX_Q_EPS, ref.INDEX_K_EPS, 1.0]))
    limit = 3.38e38 if dtype == torch.bfloat16 else 3.4e38
    kind = draw(st.sampled_from(["randn", "near_max", "tiny", "e4m3_grid", "ties"]))
    shape = (*lead, d)
    if kind == "randn":
        x = rand(shape, seed, magnitude(draw, -60, 60))
    elif kind == "near_max":
        x = rand(shape, seed).clamp(-1, 1) * limit
    elif kind == "tiny":
        x = rand(shape, seed, 1e-38)
    elif kind == "e4m3_grid":  # exact e4m3 values times a power of two: rounding ties and 448
        codes = torch.randint(0, 255, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        x = codes.view(torch.float8_e4m3fn).float() * magnitude(draw, -30, 30)
    else:
        x = torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).float() * 448.0
    x = x.to(dtype).contiguous()
    sprinkle(draw, x)
    v, s = ops.quantize_fp8(x, eps, hadamard)
    v2, s2 = ops.quantize_fp8(x, eps, hadamard)
    rv, rs = ref.quantize_fp8(x, eps, hadamard)
    assert same_bits(v.view(torch.uint8), rv.view(torch.uint8))
    assert same_bits(s, rs)  # NaN scales included, bit for bit
    assert same_bits(v.view(torch.uint8), v2.view(torch.uint8)) and same_bits(s, s2)
    fin = torch.isfinite(s)
    assert torch.equal(torch.frexp(s[fin])[0], torch.full_like(s[fin], 0.5))  # powers of two


# ------------------------------------------------------------------ cache inserts

def slot_mapping(draw, n, num_slots, seed):
    """Distinct slots (two tokens may not share one), some -1."""
    g = torch.Generator().manual_seed(seed)
    if n > num_slots:
        n_valid = num_slots
    else:
        n_valid = n
    slots = torch.full((n,), -1, dtype=torch.int64)
    perm = torch.randperm(num_slots, generator=g)[:n_valid]
    slots[torch.randperm(n, generator=g)[:n_valid]] = perm
    holes = draw(st.sampled_from(["none", "some", "all"]))
    if holes == "some" and n:
        slots[torch.rand(n, generator=g) < 0.3] = -1
    elif holes == "all":
        slots[:] = -1
    return slots


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_index_k_cache_insert(data, seed, isa):
    set_isa(isa)
    draw = data.draw
    bs = draw(st.sampled_from([1, 2, 5, 16, 64]))
    blocks = draw(st.integers(1, 6))
    n = draw(st.integers(0, min(40, blocks * bs + 3)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    hadamard = draw(st.booleans())
    k = rand((n, 128), seed, magnitude(draw, -50, 50), dtype).contiguous()
    sprinkle(draw, k)
    slots = slot_mapping(draw, n, blocks * bs, seed)
    cache = torch.randint(0, 256, (blocks, bs * 132), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    expect = cache.clone()
    ref.index_k_cache_insert(k, slots, expect, hadamard)
    c1, c2 = cache.clone(), cache.clone()
    ops.index_k_cache_insert(k, slots, c1, hadamard)
    ops.index_k_cache_insert(k, slots, c2, hadamard)
    assert torch.equal(c1, expect) and torch.equal(c1, c2)


@given(data=st.data(), seed=seeds)
def test_fuzz_mla_kv_cache_insert(data, seed):
    draw = data.draw
    bs = draw(st.sampled_from([1, 3, 16, 64]))
    blocks = draw(st.integers(1, 4))
    n = draw(st.integers(0, min(30, blocks * bs + 2)))
    src = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    cache_dt = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
    scale = magnitude(draw, -30, 30) if cache_dt == torch.uint8 else magnitude(draw, -100, 100)
    kv_c = rand((n, 512), seed, scale, src).contiguous()
    k_pe = rand((n, 64), seed + 1, scale, src).contiguous()
    sprinkle(draw, kv_c)
    sprinkle(draw, k_pe)
    slots = slot_mapping(draw, n, blocks * bs, seed)
    width = 656 if cache_dt == torch.uint8 else 576
    cache = torch.randint(0, 256, (blocks, bs, width * (1 if cache_dt == torch.uint8 else cache_dt.itemsize)),
                          dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).view(cache_dt)
    if cache_dt != torch.uint8:
        cache = cache.clone()
    expect = cache.clone()
    ref.mla_kv_cache_insert(kv_c, k_pe, slots, expect)
    c1, c2 = cache.clone(), cache.clone()
    ops.mla_kv_cache_insert(kv_c, k_pe, slots, c1)
    ops.mla_kv_cache_insert(kv_c, k_pe, slots, c2)
    assert nan_equal(c1, expect)
    assert same_bits(c1.view(torch.uint8), c2.view(torch.uint8))


# ------------------------------------------------------------------ block tables and slots

def block_table(draw, batch, max_blocks, num_blocks, seed):
    """Random block ids: repeated, out of order, shared between requests."""
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["perm", "repeats", "reversed"]))
    if kind == "perm" and batch * max_blocks <= num_blocks:
        t = torch.randperm(num_blocks, generator=g)[: batch * max_blocks]
    elif kind == "reversed":
        t = (num_blocks - 1 - torch.arange(batch * max_blocks)) % num_blocks
    else:
        t = torch.randint(0, num_blocks, (batch * max_blocks,), generator=g)
    return t.reshape(batch, max_blocks).int().contiguous()


@given(data=st.data(), seed=seeds)
def test_fuzz_positions_to_slots(data, seed):
    draw = data.draw
    batch = draw(st.integers(1, 4))
    bs = draw(st.sampled_from([1, 3, 16, 64]))
    max_blocks = draw(st.integers(1, 6))
    num_blocks = draw(st.integers(1, 12))
    table = block_table(draw, batch, max_blocks, num_blocks, seed)
    n = draw(st.integers(0, 6))
    k = draw(st.integers(0, 70))
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, max_blocks * bs, (n, k), generator=g, dtype=torch.int32)
    pos[torch.rand(n, k, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = -1
    req = torch.randint(0, batch, (n,), generator=g, dtype=torch.int32)
    out = poisoned((n, k), torch.int32)
    ops.positions_to_slots(pos, req, table, bs, num_blocks, out=out)
    again = ops.positions_to_slots(pos, req, table, bs, num_blocks)
    assert_written(out)
    assert torch.equal(out, ref.positions_to_slots(pos, req, table, bs)) and torch.equal(out, again)


@given(data=st.data())
def test_fuzz_fill_topk_buffer(data):
    draw = data.draw
    rows, width = draw(st.integers(0, 9)), draw(st.integers(1, 40))
    pad = draw(st.integers(0, 5))
    big = torch.randint(0, 1000, (rows, width + pad), dtype=torch.int32)
    off = draw(st.integers(0, pad))
    view = big[:, off:off + width]
    before = big.clone()
    num_rows = draw(st.integers(0, rows))
    ops.fill_topk_buffer_(view, num_rows)
    expect = before.clone()
    expect[:num_rows, off:off + width] = -1
    assert torch.equal(big, expect)


# ------------------------------------------------------------------ windows and top-k

def windows(draw, rows, s_kv, topk):
    """Per-row [ks, ke): lengths 0, 1, k-1, k, k+1, the whole row, or random."""
    ks, ke = [], []
    for _ in range(rows):
        kind = draw(st.sampled_from(["len", "full", "random"]))
        if kind == "full":
            a, b = 0, s_kv
        elif kind == "len":
            length = min(s_kv, max(0, draw(st.sampled_from([0, 1, topk - 1, topk, topk + 1]))))
            a = draw(st.integers(0, s_kv - length))
            b = a + length
        else:
            a = draw(st.integers(0, s_kv))
            b = draw(st.integers(a, s_kv))
        ks.append(a)
        ke.append(b)
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


def fuzz_logits(draw, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["randn", "ties", "zeros_signed", "nonfinite", "extreme"]))
    if kind == "randn":
        x = torch.randn(rows, n, generator=g)
    elif kind == "ties":
        x = torch.randint(-3, 4, (rows, n), generator=g).float()
    elif kind == "zeros_signed":  # +0 and -0 tie (ReLU-weighted sums make both)
        x = torch.randint(-1, 2, (rows, n), generator=g).float() * 0.0
        x[torch.rand(rows, n, generator=g) < 0.1] = 1.0
    elif kind == "nonfinite":
        x = torch.randn(rows, n, generator=g)
        choice = torch.randint(0, 8, (rows, n), generator=g)
        x[choice == 0] = math.nan
        x[choice == 1] = -math.nan
        x[choice == 2] = math.inf
        x[choice == 3] = -math.inf
    else:
        x = torch.randn(rows, n, generator=g).sign() * torch.tensor([3.4e38, 1e-45, 1.17e-38])[
            torch.randint(0, 3, (rows, n), generator=g)]
    return x


def check_topk(logits, ks, ke, topk, width, rows_buf):
    rows = logits.shape[0]
    out = poisoned((rows_buf, width), torch.int32)
    got = ops.topk_indices(logits, ks, ke, topk, out=out)
    assert_written(out[:rows])
    assert (out[rows:] == POISON_I).all(), "rows past the batch were touched"
    expect = ref.topk_indices(logits, ks, ke, topk, width)
    assert torch.equal(got, expect)
    assert torch.equal(ops.topk_indices(logits, ks, ke, topk, width), got)


@given(data=st.data(), seed=seeds)
def test_fuzz_topk_indices(data, seed):
    draw = data.draw
    rows = draw(st.integers(0, 6))
    n = draw(st.integers(1, draw(st.sampled_from([40, 700, 9000]))))
    topk = draw(st.integers(1, n + 3))
    width = topk + draw(st.sampled_from([0, 0, 1, 7]))
    pad, off = draw(st.integers(0, 5)), 0
    big = fuzz_logits(draw, rows, n + pad, seed)
    off = draw(st.integers(0, pad))
    logits = big[:, off:off + n]  # row stride > n, offset start (an empty slice may carry any strides)
    ks, ke = windows(draw, rows, n, topk)
    check_topk(logits, ks, ke, topk, width, rows + draw(st.integers(0, 2)))


@pytest.mark.slow
@settings(max_examples=max(5, settings.default.max_examples // 10))  # ~0.2 s an example
@given(data=st.data(), seed=seeds)
def test_fuzz_topk_indices_256k(data, seed):
    draw = data.draw
    n = 262144
    rows = draw(st.integers(1, 2))
    topk = draw(st.sampled_from([1, 2047, 2048, 2049]))
    logits = fuzz_logits(draw, rows, n, seed)
    ks, ke = windows(draw, rows, n, topk)
    check_topk(logits, ks, ke, topk, 2048 if topk <= 2048 else topk, rows)


# ------------------------------------------------------------------ indexer scoring

def indexer_inputs(draw, s_q, s_kv, h, dtype, seed, nonfinite=True):
    """q, k, k_scale, weights with magnitudes 2^e (products stay inside fp32), at a head width
    drawn from DSA's 128 and the key-pooled / QSA indexers' others (fp8: whole 128-value groups)."""
    mq, mk = magnitude(draw, -30, 30), magnitude(draw, -30, 30)
    d = draw(st.sampled_from([128, 256] if dtype == "fp8" else [128, 2, 16, 24, 96, 256]))
    q = rand((s_q, h, d), seed, mq) + 0.1 * mq
    k = rand((s_kv, d), seed + 1, mk) + 0.05 * mk
    w = rand((s_q, h), seed + 2)
    if nonfinite:
        sprinkle(draw, q)
        sprinkle(draw, k)
        sprinkle(draw, w)
    if dtype == "fp8":
        qv, qs = ref.quantize_fp8(q, ref.INDEX_Q_EPS)
        kv, ksc = ref.quantize_fp8(k, ref.INDEX_K_EPS)
        return qv, kv, ksc[:, 0].contiguous(), ref.indexer_weights(w, qs[..., 0]).contiguous()
    t = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    ksc = None
    if draw(st.booleans()):
        ksc = rand((s_kv,), seed + 3).abs() + 0.5
        if nonfinite:
            sprinkle(draw, ksc)
    return q.to(t), k.to(t), ksc, ref.indexer_weights(w).contiguous()


def abs_logits(q, k, ksc, w, ks, ke):
    """The reference on |q|, |k|, |w|: the size of the terms, for a cancellation-proof bar."""
    return ref.indexer_logits(q.float().abs(), k.float().abs(), None if ksc is None else ksc.abs(), w.abs(), ks, ke)


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_indexer_logits(data, seed, isa):
    set_isa(isa)
    draw = data.draw
    dtype = draw(st.sampled_from(["fp8", "bf16", "fp32"]))
    s_q, s_kv, h = draw(st.integers(0, 5)), draw(st.integers(0, 300)), draw(st.integers(1, 70))
    q, k, ksc, w = indexer_inputs(draw, s_q, s_kv, h, dtype, seed)
    ks, ke = windows(draw, s_q, s_kv, draw(st.integers(1, 64)))
    extra, pad = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    big = poisoned((s_q, s_kv + extra + pad), torch.float32)
    out = big[:, pad:]  # offset, row stride > columns
    ops.indexer_logits(q, k, ksc, w, ks, ke, out=out)
    assert_written(out)
    assert torch.isneginf(out[:, s_kv:]).all()
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    cmp_float(out[:, :s_kv], expect, 1e-5, abs_logits(q, k, ksc, w, ks, ke))
    assert same_bits(ops.indexer_logits(q, k, ksc, w, ks, ke), out[:, :s_kv])


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_indexer_topk(data, seed, isa):
    set_isa(isa)
    draw = data.draw
    dtype = draw(st.sampled_from(["fp8", "bf16", "fp32"]))
    s_q, s_kv, h = draw(st.integers(0, 5)), draw(st.integers(0, draw(st.sampled_from([200, 5000])))), draw(st.integers(1, 40))
    q, k, ksc, w = indexer_inputs(draw, s_q, s_kv, h, dtype, seed)
    topk = draw(st.integers(1, 300))
    width = topk + draw(st.sampled_from([0, 5]))
    ks, ke = windows(draw, s_q, s_kv, topk)
    rows_buf = s_q + draw(st.integers(0, 2))
    out = poisoned((rows_buf, width), torch.int32)
    got = ops.indexer_topk(q, k, ksc, w, ks, ke, topk, out=out)
    assert_written(got)
    assert (out[s_q:] == POISON_I).all()
    # Exactly the plain top-k of the kernel's own scores (NaN above +inf, ties low first).
    logits = ops.indexer_logits(q, k, ksc, w, ks, ke)
    assert torch.equal(got, ref.topk_indices(logits, ks, ke, topk, width))
    assert torch.equal(ops.indexer_topk(q, k, ksc, w, ks, ke, topk, width), got)
    # And the reference's own selection has the same size.
    expect = ref.indexer_topk(q, k, ksc, w, ks, ke, topk, width)
    assert torch.equal((got >= 0).sum(1), (expect >= 0).sum(1))


def paged_inputs(draw, seed):
    batch = draw(st.integers(0, 3))
    next_n = draw(st.integers(1, 3))
    h = draw(st.integers(1, 40))
    bs = draw(st.sampled_from([1, 3, 16, 64]))
    seq_lens = torch.tensor([draw(st.integers(0, 150)) for _ in range(batch)], dtype=torch.int32)
    longest = int(seq_lens.max()) if batch else 0
    max_blocks = (longest + bs - 1) // bs + draw(st.integers(0, 2))
    max_blocks = max(max_blocks, 1)
    num_blocks = max(1, draw(st.integers(1, batch * max_blocks + 2)))
    table = block_table(draw, batch, max_blocks, num_blocks, seed)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 256, (num_blocks, bs * 132), dtype=torch.uint8, generator=g)
    # Fill every slot a request reads (shared blocks get the last writer's tokens).
    for b in range(batch):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        slots = table[b, pos // bs].long() * bs + pos % bs
        kk = rand((n, 128), seed + 10 + b, magnitude(draw, -20, 20))
        sprinkle(draw, kk)
        ref.index_k_cache_insert(kk, slots, cache)
    q = rand((batch * next_n, h, 128), seed + 5, magnitude(draw, -20, 20))
    sprinkle(draw, q)
    qv, qs = ref.quantize_fp8(q, ref.INDEX_Q_EPS)
    w = ref.indexer_weights(rand((batch * next_n, h), seed + 6), qs[..., 0]).contiguous()
    return qv, w, cache, table, seq_lens, next_n, longest


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_indexer_paged(data, seed, isa):
    set_isa(isa)
    draw = data.draw
    qv, w, cache, table, seq_lens, next_n, longest = paged_inputs(draw, seed)
    rows = qv.shape[0]
    max_len = longest + draw(st.integers(0, 3))
    out = poisoned((rows, max_len), torch.float32)
    ops.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, max_len, out=out)
    assert_written(out)
    expect = ref.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, max_len)
    cmp_float(out, expect, 1e-5)
    assert same_bits(ops.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, max_len), out)
    topk = draw(st.integers(1, 160))
    width = topk + draw(st.sampled_from([0, 3]))
    buf = poisoned((rows + 1, width), torch.int32)
    got = ops.indexer_topk_paged(qv, w, cache, table, seq_lens, next_n, topk, out=buf)
    assert_written(got)
    assert (buf[rows:] == POISON_I).all()
    win = ref.decode_windows(seq_lens, next_n).clamp(min=0).int()
    assert torch.equal(got, ref.topk_indices(out, torch.zeros_like(win), win, topk, width))
    assert torch.equal(ops.indexer_topk_paged(qv, w, cache, table, seq_lens, next_n, topk, width), got)


# ------------------------------------------------------------------ sparse MLA

def mla_case(draw, seed):
    s_q = draw(st.integers(0, 4))
    h = draw(st.integers(1, 40))
    cache_kind = draw(st.sampled_from(["fp32", "bf16", "fp8"]))
    q_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    bs, blocks = draw(st.sampled_from([1, 16, 64])), draw(st.integers(1, 3))
    n = bs * blocks
    topk = draw(st.integers(1, 80))
    d_v = draw(st.sampled_from([64, 256, 512]))
    # q and kv magnitudes balance so that scores stay O(1): extremes of each, not overflow.
    e = draw(st.integers(-40, 40)) if cache_kind != "fp8" else draw(st.integers(-12, 12))
    kv_c, k_pe = rand((n, 512), seed, 2.0 ** e), rand((n, 64), seed + 1, 2.0 ** e)
    poison_rows = draw(st.booleans())
    if poison_rows:  # NaN / inf in some cache rows (selected or not)
        for _ in range(draw(st.integers(1, 3))):
            r = draw(st.integers(0, n - 1))
            (kv_c if draw(st.booleans()) else k_pe)[r, draw(st.integers(0, 63))] = draw(st.sampled_from(NONFINITE))
    width = 656 if cache_kind == "fp8" else 576
    dt = {"fp8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}[cache_kind]
    cache = torch.zeros(blocks, bs, width, dtype=dt)
    ref.mla_kv_cache_insert(kv_c, k_pe, torch.arange(n), cache)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (s_q, topk), generator=g, dtype=torch.int32)  # repeats allowed
    idx[torch.rand(s_q, topk, generator=g) < draw(st.sampled_from([0.0, 0.3]))] = -1
    if s_q and draw(st.booleans()):
        idx[draw(st.integers(0, s_q - 1))] = -1  # a row with no valid slot
    q = rand((s_q, h, 576), seed + 2, 2.0 ** -e).to(q_dtype)
    if s_q and draw(st.booleans()):  # the probe: one NaN (or inf) in one query head
        q[draw(st.integers(0, s_q - 1)), draw(st.integers(0, h - 1)), draw(st.integers(0, 575))] = draw(
            st.sampled_from(NONFINITE))
    # DESIGN §8 bars hold at DSA-sized scores; 0.5 made |scores| ~ 30, where fp32 summation
    # order alone costs ~1e-5 of out (found by the fuzz, bar not a kernel bug).
    sm_scale = draw(st.sampled_from([ref.mla_softmax_scale(128, 64, 1.0, 40.0), 0.01, 0.2]))
    return q.contiguous(), cache, idx, sm_scale, d_v


def mla_out_err(out, ro, ok, q, cache, idx, sm_scale, d_v, sinks=None):
    """rel_err of out against the reference on the rows ``ok``; for an fp8 cache the smaller of that
    and the error against the reference over the cache's rows rounded to bf16, which is what the
    bf16 paths multiply (they dequantize a row to bf16 before the bf16 products, as FlashMLA's fp8
    kernels do; docs/ops.md). With few selected keys the rounding alone can cost 1e-2 of out: 2
    keys, 2 heads, d_v 64 gave 1.06e-2 against the fp32 dequant and 0 against the bf16 one."""
    err = rel_err(out.float()[ok], ro.float()[ok])
    if cache.dtype == torch.uint8:
        rounded = ref.mla_kv_cache_dequant(cache).bfloat16().view(*cache.shape[:-1], -1)
        rb, _ = ref.sparse_mla(q, rounded, idx, sm_scale, d_v, sinks=sinks)
        err = min(err, rel_err(out.float()[ok], rb.float()[ok]))
    return err


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_sparse_mla(data, seed, isa):
    set_isa(isa)
    q, cache, idx, sm_scale, d_v = mla_case(data.draw, seed)
    s_q, h = q.shape[0], q.shape[1]
    out = poisoned((s_q, h, d_v), q.dtype)
    lse = poisoned((s_q, h), torch.float32)
    ops.sparse_mla(q, cache, idx, sm_scale, d_v, out=out, lse=lse)
    assert_written(out)
    assert_written(lse)
    ro, rl = ref.sparse_mla(q, cache, idx, sm_scale, d_v)
    bf16_path = q.dtype == torch.bfloat16 or cache.dtype != torch.float32
    exact32 = q.dtype == torch.float32 and cache.dtype == torch.float32
    note(f"bf16_path={bf16_path}")
    # NaN exactly where the reference has it (whole (t, h) rows), 0 / -inf for empty rows.
    assert torch.equal(torch.isnan(out.float()), torch.isnan(ro.float()))
    assert torch.equal(torch.isnan(lse), torch.isnan(rl)) and torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    assert not torch.isinf(out.float()).any() and not torch.isposinf(lse).any()
    ok = ~torch.isnan(rl)
    bar = 1e-5 if exact32 or (q.dtype == torch.float32 and cache.dtype != torch.uint8) else 1e-2
    if ok.any():
        assert mla_out_err(out, ro, ok, q, cache, idx, sm_scale, d_v) < bar
        fin = torch.isfinite(rl)
        if fin.any():
            # lse moves by at most the largest score error. bf16 paths round the fp8-dequantized
            # keys to bf16, a relative 2^-9 per product, so a score can be off by up to 2^-9 of
            # sm_scale * sum_i |q_i k_i| (the long profile found |lse| ~0.4 off by 0.024, past a
            # bar that scaled with |lse|; docs/ops.md).
            kv = ref.mla_kv_cache_dequant(cache)[idx.long().clamp(min=0)]  # [s_q, topk, 576]
            mag = torch.einsum("thd,tkd->thk", q.float().abs(), kv.abs().nan_to_num(0.0, 0.0, 0.0)) * sm_scale
            mag = mag.masked_fill((idx < 0).unsqueeze(1), 0.0).amax(dim=-1)
            tol = 1e-4 * (1 + rl[fin].abs()) if bar < 1e-2 else 1e-3 * (1 + rl[fin].abs()) + 2.0 ** -8 * mag[fin]
            assert ((lse[fin] - rl[fin]).abs() <= tol).all()
    o2, l2 = ops.sparse_mla(q, cache, idx, sm_scale, d_v)
    assert same_bits(o2, out) and same_bits(l2, lse)


def sinks_for(draw, h, seed):
    """fp32 [h] sinks: the scores' scale up to far above them, maybe NaN / ±inf / ±1e30 heads."""
    sinks = rand((h,), seed + 3, magnitude(draw, -6, 6))
    for _ in range(draw(st.integers(0, 3))):
        sinks[draw(st.integers(0, h - 1))] = draw(st.sampled_from([*NONFINITE, 1e30, -1e30, 0.0]))
    return sinks


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_sparse_mla_sinks(data, seed, isa):
    """Sinks on every CPU path: the reference's NaN / ±inf pattern in out and lse (docs/ops.md:
    NaN or +inf sink -> NaN on the head's rows with a valid slot; rows with none -> 0 and
    lse = the sink), the bars elsewhere, every element written, deterministic."""
    set_isa(isa)
    q, cache, idx, sm_scale, d_v = mla_case(data.draw, seed)
    s_q, h = q.shape[0], q.shape[1]
    sinks = sinks_for(data.draw, h, seed)
    out = poisoned((s_q, h, d_v), q.dtype)
    lse = poisoned((s_q, h), torch.float32)
    ops.sparse_mla(q, cache, idx, sm_scale, d_v, out=out, lse=lse, sinks=sinks)
    assert_written(out)
    assert_written(lse)
    ro, rl = ref.sparse_mla(q, cache, idx, sm_scale, d_v, sinks=sinks)
    assert torch.equal(torch.isnan(out.float()), torch.isnan(ro.float()))
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pred(lse), pred(rl)), pred.__name__
    assert not torch.isinf(out.float()).any()
    empty = (idx < 0).all(dim=-1)
    if empty.any():  # no valid slot: 0, and lse is the sink itself
        assert (out[empty].float() == 0).all()
        assert nan_equal(lse[empty], sinks.expand(s_q, h)[empty])
    exact32 = q.dtype == torch.float32 and cache.dtype == torch.float32
    bar = 1e-5 if exact32 or (q.dtype == torch.float32 and cache.dtype != torch.uint8) else 1e-2
    ok = ~torch.isnan(rl)
    if ok.any():
        assert mla_out_err(out, ro, ok, q, cache, idx, sm_scale, d_v, sinks) < bar
        fin = torch.isfinite(rl)
        if fin.any():  # as test_fuzz_sparse_mla: lse moves by at most the largest score error
            kv = ref.mla_kv_cache_dequant(cache)[idx.long().clamp(min=0)]
            mag = torch.einsum("thd,tkd->thk", q.float().abs(), kv.abs().nan_to_num(0.0, 0.0, 0.0)) * sm_scale
            mag = mag.masked_fill((idx < 0).unsqueeze(1), 0.0).amax(dim=-1)
            tol = 1e-4 * (1 + rl[fin].abs()) if bar < 1e-2 else 1e-3 * (1 + rl[fin].abs()) + 2.0 ** -8 * mag[fin]
            assert ((lse[fin] - rl[fin]).abs() <= tol).all()
    o2, l2 = ops.sparse_mla(q, cache, idx, sm_scale, d_v, sinks=sinks)
    assert same_bits(o2, out) and same_bits(l2, lse)


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_sparse_mla_minus_inf_sinks_are_no_sinks(data, seed, isa):
    """-inf sinks: the sink-free result to the bit, whatever else the inputs hold."""
    set_isa(isa)
    q, cache, idx, sm_scale, d_v = mla_case(data.draw, seed)
    plain = ops.sparse_mla(q, cache, idx, sm_scale, d_v)
    minus = ops.sparse_mla(q, cache, idx, sm_scale, d_v, sinks=torch.full((q.shape[1],), -math.inf))
    assert same_bits(plain[0], minus[0]) and same_bits(plain[1], minus[1])


def v4_case(draw, seed):
    """DeepSeek-V4's form: d_qk 512 (K = V), a bf16/fp32 cache, a selected list and a window
    list (extra_indices, maybe empty or absent) with -1 holes and repeats, maybe sinks, maybe
    NaN / inf in q, the cache or the sinks."""
    s_q, h = draw(st.integers(0, 4)), draw(st.integers(1, 40))
    dt = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    q_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    bs, blocks = draw(st.sampled_from([1, 16, 64])), draw(st.integers(1, 3))
    n = bs * blocks
    e = draw(st.integers(-30, 30))
    rows = rand((n, 512), seed, 2.0 ** e)
    if draw(st.booleans()):
        rows[draw(st.integers(0, n - 1)), draw(st.integers(0, 511))] = draw(st.sampled_from(NONFINITE))
    cache = torch.zeros(blocks, bs, 1, 512, dtype=dt)
    ref.mla_kv_cache_insert(rows[:, :448].contiguous(), rows[:, 448:].contiguous(), torch.arange(n), cache)
    g = torch.Generator().manual_seed(seed)
    lists = []
    for width in (draw(st.integers(1, 80)), draw(st.integers(0, 40))):
        ix = torch.randint(0, n, (s_q, width), generator=g, dtype=torch.int32)
        ix[torch.rand(s_q, width, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = -1
        lists.append(ix)
    idx, extra = lists[0], (lists[1] if draw(st.booleans()) else None)
    q = rand((s_q, h, 512), seed + 2, 2.0 ** -e).to(q_dtype)
    if s_q and draw(st.booleans()):
        q[draw(st.integers(0, s_q - 1)), draw(st.integers(0, h - 1)), draw(st.integers(0, 511))] = draw(
            st.sampled_from(NONFINITE))
    sinks = sinks_for(draw, h, seed) if draw(st.booleans()) else None
    return q.contiguous(), cache, idx, extra, sinks, draw(st.sampled_from([512 ** -0.5, 0.01, 0.2]))


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_sparse_mla_v4(data, seed, isa):
    """d_qk 512 with extra_indices and sinks on every CPU path: the reference's NaN / inf
    pattern, the §8 bars, every element written, deterministic."""
    set_isa(isa)
    q, cache, idx, extra, sinks, sm_scale = v4_case(data.draw, seed)
    s_q, h = q.shape[0], q.shape[1]
    out, lse = poisoned((s_q, h, 512), q.dtype), poisoned((s_q, h), torch.float32)
    ops.sparse_mla(q, cache, idx, sm_scale, out=out, lse=lse, sinks=sinks, extra_indices=extra)
    assert_written(out)
    assert_written(lse)
    ro, rl = ref.sparse_mla(q, cache, idx, sm_scale, sinks=sinks, extra_indices=extra)
    assert torch.equal(torch.isnan(out.float()), torch.isnan(ro.float()))
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pred(lse), pred(rl)), pred.__name__
    assert not torch.isinf(out.float()).any()
    bar = 1e-5 if q.dtype == torch.float32 else 1e-2
    ok = ~torch.isnan(rl)
    if ok.any():
        assert rel_err(out.float()[ok], ro.float()[ok]) < bar
        fin = torch.isfinite(rl)
        if fin.any():  # as test_fuzz_sparse_mla: lse moves by at most the largest score error
            all_idx = idx if extra is None else torch.cat((idx, extra), 1)
            kv = ref.mla_kv_cache_dequant(cache)[all_idx.long().clamp(min=0)]
            mag = torch.einsum("thd,tkd->thk", q.float().abs(), kv.abs().nan_to_num(0.0, 0.0, 0.0)) * sm_scale
            mag = mag.masked_fill((all_idx < 0).unsqueeze(1), 0.0).amax(dim=-1)
            tol = 1e-4 * (1 + rl[fin].abs()) if bar < 1e-2 else 1e-3 * (1 + rl[fin].abs()) + 2.0 ** -8 * mag[fin]
            assert ((lse[fin] - rl[fin]).abs() <= tol).all()
    o2, l2 = ops.sparse_mla(q, cache, idx, sm_scale, sinks=sinks, extra_indices=extra)
    assert same_bits(o2, out) and same_bits(l2, lse)


def test_sparse_mla_nan_in_one_head_propagates():
    """The issue's probe: one NaN in q[0, 1] makes out/lse of (0, 1) NaN and nothing else,
    on every CPU path and in the reference."""
    cache = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    ref.mla_kv_cache_insert(torch.randn(64, 512), torch.randn(64, 64), torch.arange(64), cache)
    idx = torch.randint(0, 64, (2, 16), dtype=torch.int32)
    for q_dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(2, 4, 576).to(q_dtype)
        q[0, 1, 7] = math.nan
        expect = torch.zeros(2, 4, dtype=torch.bool)
        expect[0, 1] = True
        for isa in ("auto", "portable"):
            set_isa(isa)
            out, lse = ops.sparse_mla(q, cache, idx, 0.1)
            assert torch.equal(torch.isnan(lse), expect)
            assert torch.equal(torch.isnan(out.float()).all(-1), expect) and not torch.isnan(out[~expect].float()).any()
        ro, rl = ref.sparse_mla(q, cache, idx, 0.1)
        assert torch.equal(torch.isnan(rl), expect) and torch.equal(torch.isnan(ro.float()).all(-1), expect)


# ------------------------------------------------------------------ invalid input

ERROR_CASES = [
    "mla_slot_past_cache", "mla_index_below_minus_one", "mla_out_dtype", "mla_q_noncontig", "mla_d_v",
    "mla_sinks_dtype", "mla_sinks_shape", "mla_sinks_noncontig",
    "logits_window_past", "logits_window_reversed", "logits_k_dtype", "logits_out_narrow",
    "topk_above_width", "topk_rows_above_buffer", "topk_zero", "topk_logits_dtype",
    "slots_pos_past_table", "slots_block_outside_cache", "slots_req_outside", "slots_pos_below_minus_one",
    "kins_slot_past", "kins_slot_below", "kins_k_noncontig", "mins_pe_dtype", "mins_slot_past",
    "paged_block_outside", "paged_table_short", "paged_rows", "paged_negative_len",
    "quant_width", "quant_noncontig", "fill_rows",
]


@given(case=st.sampled_from(ERROR_CASES), seed=seeds, data=st.data())
def test_fuzz_invalid_inputs_raise(case, seed, data):
    """Every invalid input raises the op's own RuntimeError and writes nothing."""
    draw = data.draw
    g = torch.Generator().manual_seed(seed)
    extra = draw(st.integers(0, 1000))
    if case.startswith("mla"):
        n = 64
        cache = torch.zeros(1, n, 576, dtype=torch.bfloat16)
        q = torch.randn(2, 3, 576).bfloat16()
        idx = torch.randint(0, n, (2, 8), generator=g, dtype=torch.int32)
        out, lse = poisoned((2, 3, 512), torch.bfloat16), poisoned((2, 3), torch.float32)
        d_v = 512
        sinks = None
        if case == "mla_slot_past_cache":
            idx[1, 3] = n + extra
            msg = f"indices holds slot {n + extra} but the cache has {n} slots"
        elif case == "mla_index_below_minus_one":
            idx[0, 0] = -2 - extra
            msg = "only -1 may mark"
        elif case == "mla_out_dtype":
            out = poisoned((2, 3, 512), torch.float32)
            msg = "out must have q's dtype"
        elif case == "mla_q_noncontig":
            q = torch.randn(3, 2, 576).bfloat16().transpose(0, 1)
            msg = "q must be contiguous"
        elif case == "mla_sinks_dtype":
            sinks = torch.zeros(3, dtype=draw(st.sampled_from([torch.float64, torch.bfloat16, torch.float16])))
            msg = "sinks must be Float"
        elif case == "mla_sinks_shape":
            sinks = torch.zeros(draw(st.sampled_from([(0,), (2,), (4 + extra,), (1, 3), (3, 1)])))
            msg = "sinks must have 1 dims" if sinks.dim() == 2 else "sinks must be \\[h_q\\] = \\[3\\]"
        elif case == "mla_sinks_noncontig":
            step = 2 + draw(st.integers(0, 3))
            sinks = torch.zeros(3 * step)[::step]
            msg = "sinks must be contiguous"
        else:
            d_v = draw(st.sampled_from([0, 100, 576, 640]))
            out = poisoned((2, 3, d_v), torch.bfloat16)
            msg = "d_v must be a multiple of 64"
        before = (bits(out).clone(), bits(lse).clone())
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.sparse_mla(q, cache, idx, 0.1, d_v, out, lse, sinks)
        assert torch.equal(bits(out), before[0]) and torch.equal(bits(lse), before[1])
    elif case.startswith("logits"):
        q, k, ksc, w = (torch.randn(3, 4, 128), torch.randn(20, 128), None, torch.randn(3, 4))
        ks, ke = torch.zeros(3, dtype=torch.int32), torch.full((3,), 20, dtype=torch.int32)
        out = poisoned((3, 20), torch.float32)
        if case == "logits_window_past":
            ke[draw(st.integers(0, 2))] = 21 + extra
            msg = "outside \\[0, 20\\]"
        elif case == "logits_window_reversed":
            ks[1], ke[1] = 5, 4
            msg = "reversed"
        elif case == "logits_k_dtype":
            k = k.bfloat16()
            msg = "k must have q's dtype"
        else:
            out = poisoned((3, 19), torch.float32)
            msg = "columns but the keys need 20"
        before = bits(out).clone()
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.indexer_logits(q, k, ksc, w, ks, ke, out)
        assert torch.equal(bits(out), before)
        if case != "logits_out_narrow":
            buf = poisoned((3, 8), torch.int32)
            with pytest.raises(RuntimeError, match=msg):
                torch.ops.indexcache.indexer_topk(q, k, ksc, w, ks, ke, 8, buf)
            assert (buf == POISON_I).all()
    elif case.startswith("topk"):
        logits = torch.randn(4, 30, generator=g)
        ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 30, dtype=torch.int32)
        buf, topk = poisoned((4, 8), torch.int32), 8
        if case == "topk_above_width":
            topk = 9 + extra
            msg = f"topk={topk} exceeds the topk buffer's width 8"
        elif case == "topk_rows_above_buffer":
            buf = poisoned((3, 8), torch.int32)
            msg = "4 tokens exceed the topk buffer's 3 rows"
        elif case == "topk_zero":
            topk = -extra
            msg = "topk must be >= 1"
        else:
            logits = logits.double()
            msg = "logits must be Float"
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.topk_indices(logits, ks, ke, topk, buf)
        assert (buf == POISON_I).all()
    elif case.startswith("slots"):
        table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
        pos = torch.randint(0, 128, (3, 5), generator=g, dtype=torch.int32)
        req = torch.tensor([0, 1, 0], dtype=torch.int32)
        num_blocks = 3
        if case == "slots_pos_past_table":
            pos[2, 4] = 128 + extra
            msg = "but the block table has 2 columns"
        elif case == "slots_block_outside_cache":
            table[1, 0] = 3 + extra
            pos[1, 0] = 1
            msg = "outside the cache's 3 blocks"
        elif case == "slots_req_outside":
            req[1] = 2 + extra
            msg = "outside the block table's 2 requests"
        else:
            pos[0, 2] = -2 - extra
            msg = "only -1 may mark"
        out = poisoned((3, 5), torch.int32)
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.positions_to_slots(pos, req, table, 64, num_blocks, out)
        assert (out == POISON_I).all()
    elif case.startswith("kins") or case.startswith("mins"):
        if case.startswith("kins"):
            cache = torch.randint(0, 256, (2, 4 * 132), dtype=torch.uint8, generator=g)
            k = torch.randn(3, 128)
            slots = torch.tensor([0, 5, -1])
            if case == "kins_slot_past":
                slots[1] = 8 + extra
                msg = f"slot_mapping holds slot {8 + extra} but the cache has 8 slots"
            elif case == "kins_slot_below":
                slots[2] = -2 - extra
                msg = "only -1 may mark"
            else:
                k = torch.randn(128, 3).t()
                msg = "k must be contiguous"
            before = cache.clone()
            with pytest.raises(RuntimeError, match=msg):
                torch.ops.indexcache.index_k_cache_insert(k, slots, cache, False)
        else:
            cache = torch.randint(0, 256, (2, 4, 656), dtype=torch.uint8, generator=g)
            kv_c, k_pe = torch.randn(2, 512), torch.randn(2, 64)
            slots = torch.tensor([1, 6])
            if case == "mins_pe_dtype":
                k_pe = k_pe.bfloat16()
                msg = "k_pe must have kv_c's dtype"
            else:
                slots[0] = 8 + extra
                msg = f"slot_mapping holds slot {8 + extra} but the cache has 8 slots"
            before = cache.clone()
            with pytest.raises(RuntimeError, match=msg):
                torch.ops.indexcache.mla_kv_cache_insert(kv_c, k_pe, slots, cache)
        assert torch.equal(cache, before)
    elif case.startswith("paged"):
        cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
        qv = torch.zeros(2, 4, 128, dtype=torch.float8_e4m3fn)
        w = torch.randn(2, 4)
        table = torch.tensor([[0, 1]], dtype=torch.int32)
        lens = torch.tensor([100], dtype=torch.int32)
        next_n = 2
        if case == "paged_block_outside":
            table[0, 1] = 2 + extra
            msg = "outside the cache's 2 blocks"
        elif case == "paged_table_short":
            lens[0] = 129 + extra
            msg = "blocks but block_table has 2 columns"
        elif case == "paged_rows":
            next_n = 1
            msg = "expected batch \\* next_n"
        else:
            lens[0] = -1 - extra
            msg = "is negative"
        out = poisoned((2, 300), torch.float32)
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.indexer_logits_paged(qv, w, cache, table, lens, next_n, out)
        assert (bits(out) == POISON_F32_BITS).all()
        buf = poisoned((2, 8), torch.int32)
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.indexer_topk_paged(qv, w, cache, table, lens, next_n, 8, buf)
        assert (buf == POISON_I).all()
    elif case.startswith("quant"):
        if case == "quant_width":
            x = torch.randn(2, 128 + 1 + extra % 127)
            msg = "last dim must be a multiple of 128"
        else:
            x = torch.randn(256, 2).t()
            msg = "x must be contiguous"
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.quantize_fp8(x, 1e-4, False)
    else:
        buf = poisoned((3, 4), torch.int32)
        with pytest.raises(RuntimeError, match="exceeds the topk buffer's 3 rows|num_rows must be >= 0"):
            torch.ops.indexcache.fill_topk_buffer_(buf, draw(st.sampled_from([4 + extra, -1 - extra])))
        assert (buf == POISON_I).all()
