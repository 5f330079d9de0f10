"""torch.ops.indexcache.delta_rule (the hybrids' linear-attention layers: GLM-5.3-Flash's KDA and
Qwen3.8-Flash-Next's Gated DeltaNet) against reference.delta_rule and against transformers' own chunk
forms, on every CPU path this machine runs (the `cpu_isa` fixture), bf16 and fp32, both gate shapes,
GQA, varlen batches continuing a nonzero state, lengths around the chunk of 64 and the recurrent /
chunked crossover, decode continuing a prefill; outputs poisoned before each call. Then the
wrapper's ValueErrors, the fake kernel, and a hypothesis fuzz case.

Bars (DESIGN.md §8, as for sparse MLA): relative error (‖a-b‖/‖b‖) below 1e-5 for fp32 outputs and
every state (the state is fp32 whatever the inputs), below 1e-2 for bf16 outputs (one bf16
rounding of each output is ~4e-3 relative per element).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import indexcache._C as _C
from indexcache import ops, reference as ref

POISON_F32_BITS = 0x7F8DEAD1  # a NaN payload no kernel makes
POISON_BF16_BITS = 0x7F81


def poisoned(shape, dtype):
    if dtype == torch.float32:
        return torch.full(shape, POISON_F32_BITS, dtype=torch.int32).view(torch.float32)
    return torch.full(shape, POISON_BF16_BITS, dtype=torch.int16).view(torch.bfloat16)


def assert_written(o):
    o = o.cpu()
    bits = o.view(torch.int32) if o.dtype == torch.float32 else o.view(torch.int16)
    assert not (bits == (POISON_F32_BITS if o.dtype == torch.float32 else POISON_BF16_BITS)).any(), \
        "an output element was not written"


def make_inputs(lens, h_k, h_v, d_k, d_v, per_channel, dtype, seed, gate=(-0.3, 0.0), strided=False, extra_slots=3):
    """Normalised q, k (as the models feed them), v ~ N(0, 1), g uniform in `gate` (log-decay),
    beta in (0.05, 0.95), a nonzero state with spare rows, sequences on shuffled rows."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def unit(*shape):
        return torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1)

    if strided:  # views of one fused projection, as a model slices it
        fused = torch.empty(T, 2 * h_k * d_k + h_v * d_v + 5, dtype=dtype)
        q = fused[:, :h_k * d_k].view(T, h_k, d_k)
        k = fused[:, h_k * d_k:2 * h_k * d_k].view(T, h_k, d_k)
        v = fused[:, 2 * h_k * d_k:2 * h_k * d_k + h_v * d_v].view(T, h_v, d_v)
        q.copy_(unit(T, h_k, d_k))
        k.copy_(unit(T, h_k, d_k))
        v.copy_(torch.randn(T, h_v, d_v, generator=gen))
    else:
        q, k = unit(T, h_k, d_k).to(dtype), unit(T, h_k, d_k).to(dtype)
        v = torch.randn(T, h_v, d_v, generator=gen).to(dtype)
    lo, hi = gate
    g = torch.rand((T, h_v, d_k) if per_channel else (T, h_v), generator=gen) * (hi - lo) + lo
    beta = torch.rand(T, h_v, generator=gen) * 0.9 + 0.05
    B = len(lens)
    state = torch.randn(B + extra_slots, h_v, d_k, d_v, generator=gen) * 0.5
    cu = torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    si = torch.randperm(B + extra_slots, generator=gen)[:B].to(torch.int32)
    return q, k, v, g, beta, state, cu, si


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def out_bar(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def run_op(q, k, v, g, beta, state, cu, si, scale):
    """The raw op with a poisoned out; checks every element was written."""
    out = poisoned(v.shape, v.dtype).to(v.device)
    torch.ops.indexcache.delta_rule(q, k, v, g, beta, state, cu, si, scale, out)
    assert_written(out)
    return out


def check_against_reference(inputs, scale=0.37):
    q, k, v, g, beta, state, cu, si = inputs
    s_op, s_ref = state.clone(), state.clone()
    o_op = run_op(q, k, v, g, beta, s_op, cu, si, scale)
    o_ref = ref.delta_rule(q, k, v, g, beta, s_ref, cu, si, scale)
    assert o_op.dtype == v.dtype and o_op.shape == v.shape
    assert torch.isfinite(o_op).all()
    assert rel_err(o_op, o_ref) < out_bar(v.dtype), rel_err(o_op, o_ref)
    assert rel_err(s_op, s_ref) < 1e-5, rel_err(s_op, s_ref)
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[si.long()] = False
    assert torch.equal(s_op[untouched], state[untouched]), "a state row no sequence continues changed"
    # Per sequence too: a short sequence's error would hide in the batch norm.
    for b in range(cu.shape[0] - 1):
        a, e = int(cu[b]), int(cu[b + 1])
        if e > a:
            assert rel_err(o_op[a:e], o_ref[a:e]) < out_bar(v.dtype), (b, rel_err(o_op[a:e], o_ref[a:e]))


DTYPES = [torch.float32, torch.bfloat16]
GATES = [pytest.param(False, id="per_head"), pytest.param(True, id="per_channel")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", GATES)
@pytest.mark.parametrize("lens,h_k,h_v,d_k,d_v", [
    ([1, 63, 64, 65, 200], 2, 4, 64, 64),  # chunk boundaries; GQA group 2
    ([15, 16, 17, 129], 1, 3, 32, 48),     # the recurrent / chunked crossover (16); group 3
    ([7, 0, 40], 2, 2, 40, 40),            # an empty sequence; dims not a multiple of the padding
    ([1, 1, 1, 1, 1, 1], 2, 4, 128, 128),  # decode: one token per sequence, the production dims
    ([300], 4, 4, 128, 128),               # one prefill, several chunks
])
def test_matches_reference(cpu_isa, dtype, per_channel, lens, h_k, h_v, d_k, d_v):
    check_against_reference(make_inputs(lens, h_k, h_v, d_k, d_v, per_channel, dtype,
                                        seed=sum(lens) * 7 + d_v + int(per_channel)))


@pytest.mark.parametrize("per_channel", GATES)
@pytest.mark.parametrize("gate", [(-12.0, -4.0), (-40.0, 0.0), (-0.5, 0.3)], ids=["strong", "extreme", "mixed_sign"])
def test_decays_outside_the_factored_range(cpu_isa, per_channel, gate):
    """Strong decays (a chunk's cumulative decay far below e^-40) take the term-by-term blocks;
    slightly positive log-decays (no model makes them, the definition allows them) too."""
    check_against_reference(make_inputs([130, 20], 1, 2, 32, 32, per_channel, torch.float32, seed=11, gate=gate))


def test_strided_token_rows(cpu_isa):
    check_against_reference(make_inputs([70, 9], 2, 4, 32, 16, True, torch.float32, seed=12, strided=True))
    check_against_reference(make_inputs([70, 9], 2, 4, 32, 16, False, torch.bfloat16, seed=13, strided=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", GATES)
def test_decode_continues_prefill(cpu_isa, dtype, per_channel):
    """Prefill 3 sequences (chunked), then decode 4 steps of one token each (recurrent): the same
    as running every token in one call (and as the reference)."""
    lens = [100, 65, 20]
    steps = 4
    total = [n + steps for n in lens]
    q, k, v, g, beta, state, cu_all, si = make_inputs(total, 2, 4, 64, 32, per_channel, dtype, seed=14)
    s_one, s_ref = state.clone(), state.clone()
    o_one = run_op(q, k, v, g, beta, s_one, cu_all, si, 0.5)
    ref.delta_rule(q, k, v, g, beta, s_ref, cu_all, si, 0.5)
    # Token ids of the prefill part and of each decode step, in the batch's order.
    starts = cu_all[:-1].tolist()
    pre = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    s_inc = state.clone()
    cu_pre = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    o_inc = torch.empty_like(o_one)
    o_inc[pre] = run_op(q[pre], k[pre], v[pre], g[pre], beta[pre], s_inc, cu_pre, si, 0.5)
    cu_dec = torch.arange(len(lens) + 1, dtype=torch.int32)
    for j in range(steps):
        rows = torch.tensor([s + n + j for s, n in zip(starts, lens)])
        o_inc[rows] = run_op(q[rows], k[rows], v[rows], g[rows], beta[rows], s_inc, cu_dec, si, 0.5)
    assert rel_err(o_inc, o_one) < out_bar(dtype)
    assert rel_err(s_inc, s_one) < 1e-5 and rel_err(s_inc, s_ref) < 1e-5


def test_deterministic(cpu_isa):
    inputs = make_inputs([200, 3, 77], 2, 4, 64, 64, True, torch.bfloat16, seed=15)
    sa, sb = inputs[5].clone(), inputs[5].clone()
    oa = run_op(*inputs[:5], sa, *inputs[6:], 0.3)
    ob = run_op(*inputs[:5], sb, *inputs[6:], 0.3)
    assert torch.equal(oa.view(torch.int16), ob.view(torch.int16)) and torch.equal(sa, sb)


def test_thread_count_does_not_change_bits():
    inputs = make_inputs([150, 40, 9], 2, 4, 32, 32, True, torch.float32, seed=16)
    outs = []
    n = torch.get_num_threads()
    try:
        for threads in (1, max(2, n)):
            torch.set_num_threads(threads)
            s = inputs[5].clone()
            outs.append((run_op(*inputs[:5], s, *inputs[6:], 0.3), s))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_cpu_path_is_reported():
    """_cpu_isa names the path delta_rule takes for each dtype, and forcing 'portable' takes it."""
    for dt in ("fp32", "bf16"):
        assert _C._cpu_isa("delta_rule", dt) in ("portable", "avx2", "avx512bf16")
    _C._set_cpu_isa("portable")
    try:
        assert _C._cpu_isa("delta_rule", "bf16") == "portable"
    finally:
        _C._set_cpu_isa("auto")
    with pytest.raises(ValueError, match="takes no dtype 'fp8'"):
        _C._cpu_isa("delta_rule", "fp8")


def test_wrapper_returns_o_and_updates_state():
    inputs = make_inputs([33, 70], 1, 2, 16, 16, True, torch.bfloat16, seed=17)
    s, s_ref = inputs[5].clone(), inputs[5].clone()
    o = ops.delta_rule(*inputs[:5], s, *inputs[6:], 0.25)
    o_ref = ref.delta_rule(*inputs[:5], s_ref, *inputs[6:], 0.25)
    assert o.dtype == torch.bfloat16 and rel_err(o, o_ref) < 1e-2 and rel_err(s, s_ref) < 1e-5


# ------------------------------------------------------------------ against transformers

def test_matches_transformers_kda(cpu_isa):
    """GLM-5.3-Flash's own chunk form (transformers' chunk_kimi_delta_attention, scale d_k^-1/2)."""
    mod = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    T, H, D = 150, 3, 64
    q, k, v, g, beta, state, cu, si = make_inputs([T], H, H, D, D, True, torch.float32, seed=18, extra_slots=0)
    o_hf, s_hf = mod.chunk_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                initial_state=state.clone(), output_final_state=True)
    s = state.clone()
    o = run_op(q, k, v, g, beta, s, cu, si, D ** -0.5)
    assert rel_err(o, o_hf[0]) < 1e-5 and rel_err(s, s_hf) < 1e-5


def test_matches_transformers_gated_deltanet(cpu_isa):
    """Qwen3.8-Flash-Next's own chunk form (transformers' torch_chunk_gated_delta_rule), with GQA."""
    mod = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    T, h_k, h_v, D = 150, 2, 4, 64
    q, k, v, g, beta, state, cu, si = make_inputs([T], h_k, h_v, D, D, False, torch.float32, seed=19, extra_slots=0)
    o_hf, s_hf = mod.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                  initial_state=state.clone(), output_final_state=True)
    s = state.clone()
    o = run_op(q, k, v, g, beta, s, cu, si, D ** -0.5)
    assert rel_err(o, o_hf[0]) < 1e-5 and rel_err(s, s_hf) < 1e-5


# ------------------------------------------------------------------ errors

def _valid():
    return list(make_inputs([3, 4], 1, 2, 8, 8, False, torch.float32, seed=20))


NAMES = ["q", "k", "v", "g", "beta", "state", "cu_seqlens", "state_indices"]


def _with(i, value):
    args = _valid()
    args[NAMES.index(i)] = value(args)
    return args


@pytest.mark.parametrize("field,bad,match", [
    ("q", lambda a: a[0].double(), "q must be float32 or bfloat16"),
    ("k", lambda a: a[1].bfloat16(), "k must have q's dtype"),
    ("v", lambda a: a[2].bfloat16(), "v must have q's dtype"),
    ("g", lambda a: a[3].bfloat16(), "g must be float32"),
    ("beta", lambda a: a[4].double(), "beta must be float32"),
    ("state", lambda a: a[5].bfloat16(), "state must be float32"),
    ("cu_seqlens", lambda a: a[6].long(), "cu_seqlens must be int32"),
    ("state_indices", lambda a: a[7].long(), "state_indices must be int32"),
    ("q", lambda a: a[0][:, :, None], r"q must be \[T, heads, dim\]"),
    ("v", lambda a: a[2].transpose(1, 2).contiguous().transpose(1, 2), r"v's \[heads, dim\] rows must be contiguous"),
    ("k", lambda a: a[1][:, :, :4].contiguous(), "k must have q's shape"),
    ("v", lambda a: a[2][:5].contiguous(), "v must have q's 7 tokens"),
    ("g", lambda a: torch.randn(7, 2, 4), r"g must be \[T, h_v\] = \[7, 2\] or \[T, h_v, d_k\] = \[7, 2, 8\]"),
    ("g", lambda a: torch.randn(2, 7).t(), "g must be contiguous"),
    ("beta", lambda a: torch.rand(7, 1), r"beta must be \[T, h_v\] = \[7, 2\]"),
    ("state", lambda a: torch.zeros(4, 2, 8, 7), r"state must be \[n_slots, h_v, d_k, d_v\]"),
    ("state", lambda a: torch.zeros(4, 2, 8, 8).transpose(2, 3), "state must be contiguous"),
    ("cu_seqlens", lambda a: torch.tensor([[0, 3, 7]], dtype=torch.int32), "cu_seqlens must be 1-d"),
    ("cu_seqlens", lambda a: torch.tensor([1, 3, 7], dtype=torch.int32), r"cu_seqlens\[0\] must be 0"),
    ("cu_seqlens", lambda a: torch.tensor([0, 5, 4, 7], dtype=torch.int32), "state_indices must have batch = 3"),
    ("cu_seqlens", lambda a: torch.tensor([0, 5, 3], dtype=torch.int32),
     r"non-decreasing, got cu_seqlens\[1\] = 5 > cu_seqlens\[2\] = 3"),
    ("cu_seqlens", lambda a: torch.tensor([0, 3, 6], dtype=torch.int32), r"cu_seqlens\[-1\] must be T = 7"),
    ("state_indices", lambda a: torch.tensor([0, 5], dtype=torch.int32), r"state_indices\[1\] = 5 is outside the state's 5 slots"),
    ("state_indices", lambda a: torch.tensor([-1, 2], dtype=torch.int32), r"state_indices\[0\] = -1 is outside"),
    ("state_indices", lambda a: torch.tensor([2, 2], dtype=torch.int32), "state_indices must be distinct"),
    ("state_indices", lambda a: torch.tensor([2], dtype=torch.int32), "state_indices must have batch = 2 entries"),
])
def test_wrapper_value_errors(field, bad, match):
    args = _with(field, bad)
    with pytest.raises(ValueError, match=match):
        ops.delta_rule(*args, 0.5)


@pytest.mark.parametrize("field,bad,match", [
    ("state_indices", lambda a: torch.tensor([2, 2], dtype=torch.int32), "state_indices must be distinct"),
    ("state_indices", lambda a: torch.tensor([0, 9], dtype=torch.int32), "outside the state's 5 slots"),
    ("cu_seqlens", lambda a: torch.tensor([0, 5, 3], dtype=torch.int32), "non-decreasing"),
    ("cu_seqlens", lambda a: torch.tensor([0, 3, 9], dtype=torch.int32), r"cu_seqlens\[-1\] must be T = 7"),
    ("g", lambda a: torch.randn(7, 2, 4), r"g must be \[T, h_v\]"),
    ("v", lambda a: a[2].transpose(1, 2).contiguous().transpose(1, 2), "v's last dim must be contiguous"),
])
def test_op_rejects_the_same(field, bad, match):
    """The C++ op checks the contract itself (TORCH_CHECK), for callers of torch.ops directly;
    nothing is written when it refuses."""
    args = _with(field, bad)
    state_before = args[5].clone()
    out = poisoned(args[2].shape, args[2].dtype)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.indexcache.delta_rule(*args, 0.5, out)
    assert torch.equal(args[5], state_before)


def test_value_heads_must_be_a_multiple_of_key_heads():
    q, k, v, g, beta, state, cu, si = make_inputs([3, 4], 2, 3, 8, 8, False, torch.float32, seed=21)
    with pytest.raises(ValueError, match=r"v's 3 heads \(h_v\) must be a multiple of q and k's 2 \(h_k\)"):
        ops.delta_rule(q, k, v, g, beta, state, cu, si, 0.5)
    with pytest.raises(RuntimeError, match=r"v's 3 heads \(h_v\) must be a multiple of q and k's 2 \(h_k\)"):
        torch.ops.indexcache.delta_rule(q, k, v, g, beta, state, cu, si, 0.5, torch.empty_like(v))


def test_other_device_is_a_value_error():
    args = _valid()
    args[4] = args[4].to("meta")
    with pytest.raises(ValueError, match="beta is on meta but q is on cpu"):
        ops.delta_rule(*args, 0.5)


# ------------------------------------------------------------------ fake kernel

def test_fake_kernel_traces_and_rejects():
    args = _valid()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        out = torch.empty(fake[2].shape, dtype=fake[2].dtype)
        torch.ops.indexcache.delta_rule(*fake, 0.5, out)
        bad = list(fake)
        bad[3] = torch.empty(7, 2, 4)
        with pytest.raises(Exception, match=r"g must be \[T, h_v\]"):
            torch.ops.indexcache.delta_rule(*bad, 0.5, out)


def test_opcheck():
    args = _valid()
    out = torch.empty_like(args[2])
    torch.library.opcheck(torch.ops.indexcache.delta_rule, (*args, 0.5, out))


def test_torch_compile_fullgraph():
    args = _valid()

    @torch.compile(fullgraph=True, backend="eager")
    def step(q, k, v, g, beta, state, cu, si):
        out = torch.empty_like(v)
        torch.ops.indexcache.delta_rule(q, k, v, g, beta, state, cu, si, 0.5, out)
        return out * 2

    s1, s2 = args[5].clone(), args[5].clone()
    o = step(*args[:5], s1, *args[6:])
    o_ref = ref.delta_rule(*args[:5], s2, *args[6:], 0.5)
    assert rel_err(o, 2 * o_ref) < 1e-5 and rel_err(s1, s2) < 1e-5


# ------------------------------------------------------------------ fuzz

isas = st.sampled_from(["auto"] + [name for name, why in _C._cpu_paths().items() if not why])


@given(data=st.data(), isa=isas)
def test_fuzz_delta_rule(data, isa):
    """Random batches (lengths 0-140, incl. the chunk edges), heads, groups, dims, gate shape and
    range, dtype and CPU path, against the reference."""
    _C._set_cpu_isa(isa)
    try:
        lens = data.draw(st.lists(st.one_of(st.integers(0, 140), st.sampled_from([1, 15, 16, 63, 64, 65, 128])),
                                  min_size=1, max_size=4))
        h_k = data.draw(st.integers(1, 2))
        h_v = h_k * data.draw(st.integers(1, 3))
        d_k = data.draw(st.sampled_from([1, 5, 16, 33, 64]))
        d_v = data.draw(st.sampled_from([1, 7, 32, 40, 64]))
        per_channel = data.draw(st.booleans())
        dtype = data.draw(st.sampled_from(DTYPES))
        lo = data.draw(st.sampled_from([-0.05, -1.0, -8.0, -60.0]))
        inputs = make_inputs(lens, h_k, h_v, d_k, d_v, per_channel, dtype, seed=data.draw(st.integers(0, 2**31 - 1)),
                             gate=(lo, 0.0))
        if sum(lens) == 0:
            s = inputs[5].clone()
            o = run_op(*inputs[:5], s, *inputs[6:], 0.5)
            assert o.numel() == 0 and torch.equal(s, inputs[5])
            return
        q, k, v, g, beta, state, cu, si = inputs
        s_op, s_ref = state.clone(), state.clone()
        o_op = run_op(q, k, v, g, beta, s_op, cu, si, 0.5)
        o_ref = ref.delta_rule(q, k, v, g, beta, s_ref, cu, si, 0.5)
        assert torch.isfinite(o_op).all()
        # Absolute floor: a d_k of 1 with strong decays leaves outputs near 0, where a relative bar
        # means nothing; 1e-6 of the inputs' unit scale is far below any real error.
        err = (o_op.double() - o_ref.double()).norm().item()
        assert err <= out_bar(dtype) * o_ref.double().norm().item() + 1e-6 * o_ref.numel() ** 0.5
        err_s = (s_op.double() - s_ref.double()).norm().item()
        assert err_s <= 1e-5 * s_ref.double().norm().item() + 1e-6 * s_ref.numel() ** 0.5
    finally:
        _C._set_cpu_isa("auto")


# ------------------------------------------------------------------ CUDA (skipped without a GPU)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", GATES)
def test_cuda_matches_reference(dtype, per_channel):
    """The CUDA kernel on a real device (the emulator tests its logic on CPU-only machines)."""
    inputs = make_inputs([1, 63, 64, 65, 200, 1, 1], 2, 4, 128, 128, per_channel, dtype, seed=30)
    q, k, v, g, beta, state, cu, si = [t.cuda() for t in inputs]
    s_dev, s_ref = state.clone(), inputs[5].clone()
    o_dev = run_op(q, k, v, g, beta, s_dev, cu, si, 0.3)
    o_ref = ref.delta_rule(*inputs[:5], s_ref, *inputs[6:], 0.3)
    assert rel_err(o_dev.cpu(), o_ref) < out_bar(dtype) and rel_err(s_dev.cpu(), s_ref) < 1e-5
    o_ops = ops.delta_rule(q, k, v, g, beta, state.clone(), cu, si, 0.3)
    assert torch.equal(o_ops, o_dev)  # deterministic: the same bits on a second run
