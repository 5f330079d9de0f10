"""MiniMax-M3 on vLLM's CPU platform: vLLM 0.32 has no CPU model for it, so the plugin serves this
package's (:mod:`indexcache.models.minimax_m3`: GQA with QK-norm and partial RoPE, the block-sparse
indexer of the ``minimax_m3_sparse`` layers, SwiGLU-OAI MoE, IndexCache over the sparse layers) over
vLLM's paged caches (:mod:`.vllm_native`). A text checkpoint (``MiniMaxM3VLForCausalLM``,
``minimax_m3_vl_text``) and a VL one (``MiniMaxM3SparseForConditionalGeneration``, ``minimax_m3_vl``:
its text tower, the vision tower's tensors passed over) are told apart by their ``model_type``."""

from .vllm_native import NativeForCausalLM


class IndexCacheMiniMaxM3VLForCausalLM(NativeForCausalLM):
    architecture = "MiniMaxM3VLForCausalLM"  # family: from config.json's model_type


class IndexCacheMiniMaxM3SparseForConditionalGeneration(NativeForCausalLM):
    architecture = "MiniMaxM3SparseForConditionalGeneration"
