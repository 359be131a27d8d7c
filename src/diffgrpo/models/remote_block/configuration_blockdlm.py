"""The configuration of :mod:`.modeling_blockdlm` (``model_type`` ``blockdlm``): sizes, rotary base, the attention
block ``block_size`` and the ``mask_token_id``, as the released block-diffusion configurations (SDAR, TraDo) name
them. Standalone: it imports only transformers, so a model directory can ship it as remote code."""
from transformers import PretrainedConfig


class BlockDLMConfig(PretrainedConfig):
    model_type = "blockdlm"

    def __init__(self, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                 rms_norm_eps=1e-6, block_size=4, mask_token_id=2, initializer_range=0.02,
                 tie_word_embeddings=False, **kw):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.max_position_embeddings = num_key_value_heads, max_position_embeddings
        self.rope_theta, self.rms_norm_eps, self.initializer_range = rope_theta, rms_norm_eps, initializer_range
        self.block_size, self.mask_token_id = block_size, mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kw)
