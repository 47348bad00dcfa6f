"""The data path: sources -> formats -> tokenisation and loss masks -> cache -> collators and loaders; streamed
sources in `stream`. The packed-attention names (`attention_inputs`, `use_packed_attention`, ...) live in
`tunebook.models.attention` and are re-exported here, where recipes import them with the collators."""

from ..models.attention import attention_inputs, packing_mechanism, segment_sdpa_attention, use_packed_attention
from .cache import cached_dataset, default_cache_dir, fingerprint, tokenizer_fingerprint
from .classification import ClassificationData, label_names_of, prepare_classification_data
from .collate import PackedCollator, PadCollator, PairCollator, PromptCollator, loss_positions
from .formats import FORMAT_COLUMNS, detect_format, normalise_messages, to_conversations
from .image_files import open_image, open_images
from .images import check_images, parse_image_row, read_image_source
from .loaders import LengthGroupedSampler, build_loader, train_and_eval_loaders
from .packing import best_fit_decreasing, example_lengths, pack_dataset
from .pipeline import Pipeline, PreparedData
from .sft import SFTData, conversation_texts, load_conversations, prepare_sft_data, prepare_sft_dataset, sft_cache_key
from .sources import DataSource, fingerprint_sources, load_source, parse_sources
from .synthetic import write_synthetic_image_task, write_synthetic_task
from .text import TextData, chunk_documents, prepare_text_data
from .tokenize import IGNORE_INDEX, assistant_spans, format_loss_mask, render_chat, tokenize_conversations
from .vision_collate import (
    VisionCollator,
    VisionPackedCollator,
    VisionPairCollator,
    VisionPromptCollator,
    image_columns,
)
from .vision_sft import prepare_sft_or_vision_data, prepare_vision_sft_data, uses_images
from .vision_tokenize import tokenize_image_conversation

__all__ = [
    "Pipeline",
    "PreparedData",
    "PairCollator",
    "TextData",
    "chunk_documents",
    "prepare_text_data",
    "ClassificationData",
    "label_names_of",
    "prepare_classification_data",
    "FORMAT_COLUMNS",
    "IGNORE_INDEX",
    "DataSource",
    "LengthGroupedSampler",
    "PackedCollator",
    "PadCollator",
    "PromptCollator",
    "SFTData",
    "attention_inputs",
    "best_fit_decreasing",
    "example_lengths",
    "pack_dataset",
    "packing_mechanism",
    "prepare_sft_data",
    "segment_sdpa_attention",
    "use_packed_attention",
    "sft_cache_key",
    "assistant_spans",
    "build_loader",
    "train_and_eval_loaders",
    "cached_dataset",
    "conversation_texts",
    "default_cache_dir",
    "detect_format",
    "fingerprint",
    "fingerprint_sources",
    "format_loss_mask",
    "load_conversations",
    "load_source",
    "loss_positions",
    "parse_sources",
    "prepare_sft_dataset",
    "to_conversations",
    "normalise_messages",
    "tokenize_conversations",
    "render_chat",
    "tokenizer_fingerprint",
    "write_synthetic_task",
    "write_synthetic_image_task",
    "check_images",
    "open_image",
    "open_images",
    "parse_image_row",
    "read_image_source",
    "VisionCollator",
    "VisionPackedCollator",
    "VisionPairCollator",
    "VisionPromptCollator",
    "prepare_sft_or_vision_data",
    "prepare_vision_sft_data",
    "tokenize_image_conversation",
    "uses_images",
    "image_columns",
]
