"""Named tiny model configs for the offline default and the tests (built from config, never downloaded)."""

from __future__ import annotations

__all__ = ["TINY_BERT", "TINY_LLAMA"]

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

# A 2-layer BERT encoder for the classification default: learns the generated topic task in well under a minute.
TINY_BERT = {
    "model_type": "bert",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 256,
}
