"""Every number of the data formats, defined once (DESIGN.md §4, §5): the kernels' fixed widths,
the FP8 formats, the cache layouts, the quantization floors and the checkpoints' storage rules.
The other modules import these names (``reference``, ``models.args`` and ``parallel`` re-export
some under the names they have always had); nothing here imports anything."""

# ---------------------------------------------------------------- FP8 (e4m3)
FP8_MAX = 448.0                  # largest finite torch.float8_e4m3fn value
QUANT_GROUP = 128                # values per fp8 scale: an index key, a quarter of the MLA latent
FP8_WEIGHT_BLOCK = (128, 128)    # one fp32 weight_scale_inv per block of a block-FP8 checkpoint
FP8_WEIGHT_AMAX_FLOOR = 1e-12    # floor on a weight block's (and an activation group's) amax

# ---------------------------------------------------------------- the indexer (DESIGN.md §4)
INDEX_HEAD_DIM = 128                                 # one fp8 scale group per indexer key
INDEX_K_BYTES = INDEX_HEAD_DIM + 4                   # 132: fp8 key + its fp32 scale, per token per F layer
MAX_INDEXER_HEAD_DIM = 256                           # widest head the dense indexer ops take (even widths)
INDEX_Q_EPS, INDEX_K_EPS = 1e-10, 1e-4               # floors on the amax of a query head / a key
INDEX_K_NORM_EPS = 1e-6                              # the indexer's key LayerNorm

# ---------------------------------------------------------------- sparse MLA (DESIGN.md §5)
MLA_LATENT, MLA_ROPE = 512, 64                       # the kernels' latent KV: 512 + 64
MLA_KV_WIDTH = MLA_LATENT + MLA_ROPE                 # 576 values per token (bf16/fp32 cache)
MLA_FP8_SCALES = MLA_LATENT // QUANT_GROUP           # 4 fp32 scales per token in fp8_ds_mla
MLA_FP8_SCALE_END = MLA_LATENT + 4 * MLA_FP8_SCALES  # 528: where the bf16 rope part of a row begins
FP8_DS_MLA_BYTES = MLA_FP8_SCALE_END + 2 * MLA_ROPE  # 656: e4m3 latent, fp32 scales, bf16 rope
MLA_FP8_EPS = 1e-4                                   # floor on the per-128 amax of the fp8_ds_mla cache
LATENT_NORM_EPS = 1e-6  # q_a / kv_a RMSNorm: DeepSeek's reference and transformers, whatever rms_norm_eps says

# ---------------------------------------------------------------- paged caches
BLOCK_SIZE = 64                  # tokens per block (MLA and index-K caches share block tables)

# ---------------------------------------------------------------- checkpoint storage
# Kept in fp32 whatever the model dtype: the indexer's head weights and the router bias (as the
# checkpoints store them).
FP32_PARAMS = ("weights_proj.weight", "e_score_correction_bias")
# The LM heads: logits are always fp32 sums (DeepSeek's reference computes them in fp32). A bf16
# model holds its heads in bf16 when the checkpoint stores them so (the official ones do: the values
# are exactly bf16, and half the bytes a decode step reads); any other model, or a checkpoint
# storing them wider, holds them fp32 (parallel.vocab.head_dtype). Written in the model's dtype.
FP32_HEADS = ("lm_head.weight", "shared_head.head.weight")
# Linear layers that the official checkpoints store in block FP8.
FP8_LINEAR_NAMES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj", "wq_b", "wk")
