"""HY-V4's block on each device (the `-k cuda` cases run in bench/gpu_check.sh): a model built
from its config at the production widths (latent 512 + 64, qk_nope 192, v 256, indexer 128) with
sinks, the output gate and hyper-connections, in bf16 through the kernels, against the same
weights in fp32 on the CPU. Windows no longer than index_topk, so the selection is the whole
causal window on both sides and only the arithmetic differs. Needs no transformers."""

import torch

from indexcache.models import BatchMeta, HYV4ForCausalLM

CFG = dict(model_type="hy_v4", vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
           num_hidden_layers=4, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=192,
           qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
           index_n_heads=4, index_head_dim=128, index_topk=64, max_position_embeddings=512,
           mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full", "full", "shared", "shared"],
           use_index_cache=True)


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def paged_logits(model, seq, prefill, chunk, kv_cache_dtype):
    """Prefill ``prefill`` tokens in chunks of ``chunk``, then decode the rest one by one."""
    cache = model.allocate_cache(-(-len(seq) // 64), kv_cache_dtype)
    cache.manager.allocate("r", len(seq))
    out, done = [], 0
    while done < len(seq):
        n = min(chunk, prefill - done) if done < prefill else 1
        ids = torch.tensor(seq[done:done + n], device=model.device)
        h = model.forward_tokens(ids, BatchMeta.paged_batch(cache, ["r"], [done], [n]), cache)
        out.append(model.compute_logits(h))
        done += n
    return torch.cat(out)


def test_hy_v4_bf16_kernels_on_device(device):  # device: cpu, and cuda where there is one (conftest.py)
    ref = HYV4ForCausalLM.from_config(CFG, dtype=torch.float32, seed=2, indexer_fp8=False)
    model = HYV4ForCausalLM.from_config(CFG, dtype=torch.bfloat16, device=device, seed=2)
    assert model.plan.pattern == "FFSS" and model.model.layers[0].self_attn.sinks.dtype == torch.float32
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    want = ref(ids)
    got = model(ids.to(device))
    assert torch.isfinite(got).all() and rel(got, want) < 3e-2
    seq = ids[0].tolist()
    for kv in ("bf16", "fp8_ds_mla"):
        paged = paged_logits(model, seq, 17, 8, kv)
        assert torch.isfinite(paged).all() and rel(paged, want[0]) < (3e-2 if kv == "bf16" else 0.2), kv
