"""Load a tokenizer, or train a small byte-level BPE tokenizer locally with a ChatML chat template.

The local tokenizer lets the default recipe and the tests run with no Hub access. Digits are split one per
token so digit-manipulation tasks are learnable by tiny models.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..errors import ModelError, first_line
from ..locations import looks_like_local_path

__all__ = ["CHATML_TEMPLATE", "config_tokenizer", "load_tokenizer", "train_chat_tokenizer", "train_encoder_tokenizer"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VERSION = "1"  # bump when train_chat_tokenizer changes what it produces


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` and wrap it with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def train_encoder_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a lower-casing WordPiece tokenizer, BERT style: `[CLS] a [SEP]` and `[CLS] a [SEP] b [SEP]` with
    token type ids, for encoder classifiers built from a config."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        texts, trainer=trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


TRAINERS = {"chat": train_chat_tokenizer, "encoder": train_encoder_tokenizer}


def trained_tokenizer_dir(cache_dir: str | Path, data_fingerprint: str, vocab_size: int, kind: str = "chat") -> Path:
    parts = f"{data_fingerprint}|{vocab_size}|{TOKENIZER_VERSION}" + ("" if kind == "chat" else f"|{kind}")
    return Path(cache_dir) / "tokenizers" / hashlib.sha256(parts.encode()).hexdigest()[:16]


def load_or_train_tokenizer(
    cache_dir: str | Path,
    data_fingerprint: str,
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
    kind: str = "chat",
) -> tuple[PreTrainedTokenizerFast, bool]:
    """Train on `texts()` on first use, cached by the data's fingerprint; returns (tokenizer, was_trained).

    `kind`: `chat` (byte-level BPE with a ChatML template, for causal LMs) or `encoder` (WordPiece, BERT style).
    """
    directory = trained_tokenizer_dir(cache_dir, data_fingerprint, vocab_size, kind)
    if (directory / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(directory), False
    tokenizer = TRAINERS[kind](texts(), vocab_size)
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(directory)
    except OSError:  # another process finished first; its files are identical
        pass
    return AutoTokenizer.from_pretrained(directory), True


def config_tokenizer(config, cache_dir, data_fingerprint: str, texts, built: list, log, kind: str = "chat"):
    """The tokenizer a recipe config asks for: `tokenizer_name_or_path` or the model's, else one trained on
    `texts()` (once; cached by `data_fingerprint`, see `load_or_train_tokenizer`). Adds "tokenizer" to `built`
    when it trained one."""
    if config.tokenizer_name_or_path or config.model_name_or_path:
        return load_tokenizer(config.tokenizer_name_or_path or config.model_name_or_path, config.trust_remote_code)
    tokenizer, trained = load_or_train_tokenizer(cache_dir, data_fingerprint, texts, config.tokenizer_vocab_size, kind)
    if trained:
        built.append("tokenizer")
    what = "WordPiece" if kind == "encoder" else "BPE"
    log.info(
        "%s a %d-token %s tokenizer on the training data", "Trained" if trained else "Reusing", len(tokenizer), what
    )
    return tokenizer


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained` with a readable error for a missing path or an offline Hub name."""
    if looks_like_local_path(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise ModelError(f"tokenizer path not found: {name_or_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        kind = "directory" if looks_like_local_path(name_or_path) else "Hub name"
        raise ModelError(f"could not load a tokenizer from {kind} '{name_or_path}': {first_line(e)}") from None
    if tokenizer.pad_token is None:
        # Padding positions are masked out of attention and loss, so any existing token serves.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
