"""A tiny target config shared by the drafter_trainer tests (the real one is SmolLM2's)."""

TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "quantization_config": {"quant_method": "gguf"},
}
