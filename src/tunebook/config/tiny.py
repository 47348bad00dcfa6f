"""Named tiny model configs for the offline default and the tests (built from config, never downloaded)."""

from __future__ import annotations

__all__ = ["TINY_BERT", "TINY_LLAMA", "TINY_LLAVA", "TINY_QWEN2_5_VL", "TINY_QWEN2_VL", "TINY_STUDENT"]

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

# Tiny vision-language models (tunebook.models.vision fills in the vocabulary size and the image token ids from the
# processor's tokenizer). Both language models are 2 x 64; the vision towers one 32-wide layer over 14-pixel patches.

_TINY_VLM_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# Qwen2-VL: dynamic image tokens, one per 2 x 2 patches (28 x 28 pixels) of the image as resized. head_dim 16, so the
# rotary's 8 frequency pairs split over time, height and width as 2 + 3 + 3 (mrope_section).
TINY_QWEN2_VL = {
    "model_type": "qwen2_vl",
    "text_config": {
        **_TINY_VLM_TEXT,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    },
    "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2},
}

# Qwen2.5-VL: Qwen2-VL's processor and tokens, a windowed vision tower whose merger projects to out_hidden_size.
TINY_QWEN2_5_VL = {
    "model_type": "qwen2_5_vl",
    "text_config": dict(TINY_QWEN2_VL["text_config"]),
    "vision_config": {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "window_size": 56,
        "fullatt_block_indexes": [0],
    },
}

# LLaVA (CLIP vision tower, Llama language model): a fixed 4 image tokens per image, each picture resized and cropped
# to 28 x 28 pixels (2 x 2 patches; the CLIP class token is dropped, vision_feature_select_strategy default).
TINY_LLAVA = {
    "model_type": "llava",
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
        "projection_dim": 32,
    },
    "text_config": {"model_type": "llama", **_TINY_VLM_TEXT},
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "image_seq_length": 4,
}

# The distillation default's student: the tiny Llama at half its depth (0.59M parameters of the teacher's 1.09M). A
# narrower one of four layers (width 96: 0.64M) learnt the digit task from the teacher about four times slower.
TINY_STUDENT = {**TINY_LLAMA, "num_hidden_layers": 2}
