"""The CPU ops' one-thread work bounds (csrc/cpu/serial_work.h): rows_matmul and sparse_mla run a
call below their bound on the calling thread instead of opening an OpenMP region. The splits depend
on the shape only, so at 2 threads every result is bit-equal whether each call runs inline (bound
huge), always splits (bound 0) or follows the default; each is checked against the reference. The
bounds are read once per process from INDEXCACHE_ROWS_MATMUL_SERIAL_WORK and
INDEXCACHE_SPARSE_MLA_SERIAL_WORK, so each setting runs in a child process; a bad value is an error
naming the variable."""

import os
import subprocess
import sys

import pytest
import torch

from indexcache import reference

ROWS_ENV, MLA_ENV = "INDEXCACHE_ROWS_MATMUL_SERIAL_WORK", "INDEXCACHE_SPARSE_MLA_SERIAL_WORK"

# Each case's inputs from a seed the parent passes; outputs poisoned (NaN) before the call.
CHILD = r"""
import sys
import torch
from indexcache import _C, ops
isa, seed, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
_C._set_cpu_isa(isa)
torch.set_num_threads(2)
g = torch.Generator().manual_seed(seed)
res = {}
for n, k in [(64, 512), (576, 512), (8192, 512)]:   # below / above rows_matmul's default bound
    x = torch.randn(1, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    out = torch.full((1, n), float("nan"))
    res[f"rows_{n}"] = (x, w, ops.rows_matmul(x, w, True, out=out))
for dt in (torch.bfloat16, torch.float32):
    for s_q, h in [(1, 4), (1, 16), (1, 64), (3, 16)]:   # a 4-head decode row is below sparse_mla's default
        cache = torch.randn(700, 1, 576, generator=g).to(dt)
        idx = torch.randint(0, 700, (s_q, 512), generator=g, dtype=torch.int32)
        idx[:, ::9] = -1
        q = torch.randn(s_q, h, 576, generator=g).to(dt)
        out = torch.full((s_q, h, 512), float("nan"), dtype=dt)
        lse = torch.full((s_q, h), float("nan"))
        ops.sparse_mla(q, cache, idx, 576 ** -0.5, out=out, lse=lse)
        res[f"mla_{dt}_{s_q}x{h}"] = (q, cache, idx, out, lse)
torch.save(res, path)
"""

BAD_CHILD = r"""
import torch
from indexcache import ops
for name, call in [("rows", lambda: ops.rows_matmul(torch.ones(1, 8), torch.ones(4, 8), True)),
                   ("mla", lambda: ops.sparse_mla(torch.ones(1, 1, 576), torch.ones(4, 1, 576),
                                                  torch.zeros(1, 4, dtype=torch.int32), 0.1))]:
    try:
        call()
        print(name, "ACCEPTED")
    except RuntimeError as e:
        print(name, "REFUSED", str(e).splitlines()[0])
"""


def _child(script, env_over, *args):
    env = {k: v for k, v in os.environ.items() if k not in (ROWS_ENV, MLA_ENV)}
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_results_do_not_depend_on_the_bounds(cpu_isa, tmp_path):
    seed = int(torch.randint(0, 2**31, ()))
    settings = {"default": {}, "inline": {ROWS_ENV: str(1 << 62), MLA_ENV: str(1 << 62)},
                "split": {ROWS_ENV: "0", MLA_ENV: "0"}}
    got = {}
    for name, env in settings.items():
        path = tmp_path / f"{name}.pt"
        r = _child(CHILD, env, cpu_isa, str(seed), str(path))
        assert r.returncode == 0, r.stderr
        got[name] = torch.load(path)
    base = got["default"]
    for name in ("inline", "split"):
        for key, vals in base.items():
            for a, b in zip(vals, got[name][key]):
                assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                   b.view(torch.int16) if b.dtype == torch.bfloat16 else b), (name, key)
    for key, vals in base.items():
        if key.startswith("rows"):
            x, w, out = vals
            ref = reference.rows_matmul(x, w, True, torch.float32)
            assert torch.isfinite(out).all()
            assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
        else:
            q, cache, idx, out, lse = vals
            ro, rl = reference.sparse_mla(q, cache, idx, 576 ** -0.5)
            tol = 1e-5 if q.dtype == torch.float32 else 1e-2
            assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
            assert (out.float() - ro.float()).norm() <= tol * ro.float().norm(), key
            assert (lse - rl).abs().max() < 1e-3, key


@pytest.mark.parametrize("value", ["-3", "12x", "lots"])
def test_bad_bound_is_refused_by_name(value):
    r = _child(BAD_CHILD, {ROWS_ENV: value, MLA_ENV: value})
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["rows"].startswith("REFUSED") and ROWS_ENV in lines["rows"] and value in lines["rows"]
    assert lines["mla"].startswith("REFUSED") and MLA_ENV in lines["mla"] and value in lines["mla"]
