"""Storage conventions of DSA checkpoints shared by the model, the loader and the tools."""

# Kept in fp32 whatever the model dtype: the indexer's head weights and the router bias (as the
# checkpoints store them), and the LM heads, whose logits DeepSeek's reference computes in fp32.
FP32_PARAMS = ("weights_proj.weight", "e_score_correction_bias", "lm_head.weight", "shared_head.head.weight")
# The LM heads: fp32 parameters in the model, written in the model's dtype like every other weight
# of the official checkpoints.
FP32_HEADS = ("lm_head.weight", "shared_head.head.weight")
