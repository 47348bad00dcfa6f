"""Named tiny model configs for the offline default and the tests (built from config, never downloaded)."""

from __future__ import annotations

__all__ = ["TINY_LLAMA"]

# About 1M parameters with a 512-token vocabulary: learns the synthetic digit task in a CPU minute.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
