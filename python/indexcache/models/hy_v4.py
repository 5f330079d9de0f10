"""HY-V4 (``model_type: hy_v4``, transformers' ``HYV4ForCausalLM``): Tencent HunYuan's DSA family,
which ships IndexCache in its checkpoints (``indexer_types``: full at layer 0 and at every
``(l - 1) % 4 == 0``, shared elsewhere; shared layers carry no indexer tensors).

The DeepSeek-V3.2 block with these departures, each a switch of the generic blocks
(``ModelArgs``), all set here:

- MLA with the 512 + 64 latent, qk_nope 192 and v 256; RoPE in NeoX split-half layout (MLA and
  indexer), the indexer rotating the **last** 64 of its 128 dims; the indexer's key LayerNorm at
  ``rms_norm_eps``;
- a learned fp32 **sink** logit per head in the attention softmax (``self_attn.sinks``) and a
  **sigmoid output gate** per head and value dim (``self_attn.gate_proj``), before ``o_proj``;
- **independent hyper-connections** (``blocks/hyper.py``): ``hc_mult`` residual streams mixed in
  fp32 around attention (``attn_hc``) and the MLP (``ffn_hc``), collapsed by ``hc_head``;
- ``mlp_layer_types`` (dense / sparse), global routing (one expert group), routed experts stored
  fused (``experts.gate_up_proj`` / ``experts.down_proj``) with the SwiGLU clamp ``swiglu_limit``.

Checkpoints are read by their own tensor names (``checkpoint_renames``: transformers renames
them at load, e.g. ``hc_pre.hc_attn_layer.hc_fn`` -> ``attn_hc.fn``, ``linear_gate`` ->
``gate_proj``, ``learnable_sink_param`` -> ``sinks``); the blocks use transformers' in-memory
names. MTP layers (``model.mtp_layers``, which transformers ignores too) are neither built nor
read, whatever ``num_nextn_predict_layers`` says.
"""

from __future__ import annotations

from .dsa import DSAForCausalLM


class HYV4ForCausalLM(DSAForCausalLM):
    model_type = "hy_v4"
    architecture = "HYV4ForCausalLM"
    config_defaults = {
        "rms_norm_eps": 1e-5, "n_group": 1, "topk_group": 1, "indexer_rope_interleave": False,
        "mla_rope_interleave": False, "indexer_rope_tail": True, "attn_sinks": True, "attn_gate": True,
        "hc_mult": 4, "hc_magnitude": 2.0, "hc_eps": 1e-6, "fused_experts": True, "swiglu_limit": 10.0,
        "num_nextn_predict_layers": 0,
    }
    fp32_params = ("self_attn.sinks", "attn_hc.fn", "attn_hc.base", "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base",
                   "ffn_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale", "mlp.gate.weight",
                   "indexer.k_norm.weight", "indexer.k_norm.bias")
    checkpoint_renames = (
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", lambda m: f".hc_pre.hc_{'attn' if m[1] == 'attn' else 'mlp'}_layer.hc_{m[2]}"),
        (r"^model\.hc_head\.hc_(fn|base|scale)$", r"model.hc_pre.hc_head.hc_head_\1"),
        (r"\.self_attn\.sinks$", ".self_attn.learnable_sink_param"),
        (r"\.gate_proj\.", ".linear_gate."),
    )

    @classmethod
    def family_config(cls, config: dict) -> dict:
        c = dict(config)
        # transformers' HYV4Indexer builds its key LayerNorm with the model's rms_norm_eps
        if c.get("index_k_norm_eps") is None:
            c["index_k_norm_eps"] = c.get("rms_norm_eps") or cls.config_defaults["rms_norm_eps"]
        # MTP layers (model.mtp_layers.*) are not run, as transformers does not run them: the main
        # model is built without them and the loader passes over their tensors
        c["num_nextn_predict_layers"] = 0
        return c
