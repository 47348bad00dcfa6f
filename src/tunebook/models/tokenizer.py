"""Load a tokenizer, or train a small byte-level BPE tokenizer locally with a ChatML chat template.

The local tokenizer lets the default recipe and the tests run with no Hub access. Digits are split one per
token so digit-manipulation tasks are learnable by tiny models.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..errors import ModelError, first_line
from ..locations import looks_like_local_path
from ..preparation import preparation_lock
from .saving import save_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "config_tokenizer",
    "load_tokenizer",
    "save_tokenizer",
    "setup_chat_template",
    "text_pieces",
    "tokenizer_max_chars",
    "train_chat_tokenizer",
    "train_encoder_tokenizer",
]

# ChatML, with tool definitions in the system turn and tool calls as <tool_call> JSON (the Hermes/Qwen convention),
# so a tokenizer without a template of its own can train on tool-calling data too. Without tools it renders exactly
# `<|im_start|>{role}\n{content}<|im_end|>\n` per message.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call these functions:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\n</tools>\nTo call one, reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{%- if message['tool_calls'] is defined %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + (fn['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VERSION = "3"  # bump when train_chat_tokenizer changes what it produces
# The longest token a locally trained BPE tokenizer may learn, in characters of its byte-level alphabet (one per
# byte). Every token then spells at most this many characters of text, so a text longer than N times this cannot fit
# in N tokens: what bounds the texts it is trained on (`load_or_train_tokenizer`). Ordinary text never asks for longer
# tokens at these vocabulary sizes (the cap then changes nothing); a run of one repeated character would.
MAX_TOKEN_CHARS = 32
TOKENIZER_STATS = "tunebook_tokenizer.json"  # beside a trained tokenizer's files: what it was trained on


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
        max_token_length=MAX_TOKEN_CHARS,
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


def trained_tokenizer_dir(
    cache_dir: str | Path, data_fingerprint: str, vocab_size: int, kind: str = "chat", max_chars: int | None = None
) -> Path:
    parts = f"{data_fingerprint}|{vocab_size}|{TOKENIZER_VERSION}" + ("" if kind == "chat" else f"|{kind}")
    parts += "" if max_chars is None else f"|{max_chars}"
    return Path(cache_dir) / "tokenizers" / hashlib.sha256(parts.encode()).hexdigest()[:16]


def load_or_train_tokenizer(
    cache_dir: str | Path,
    data_fingerprint: str,
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
    kind: str = "chat",
    max_chars: int | None = None,
    stats: dict | None = None,
) -> tuple[PreTrainedTokenizerFast, bool]:
    """Train on `texts()` on first use, cached by the data's fingerprint; returns (tokenizer, was_trained).

    `kind`: `chat` (byte-level BPE with a ChatML template, for causal LMs) or `encoder` (WordPiece, BERT style).
    Texts longer than `max_chars` characters are left out of training (`tokenizer_texts_overlong` in `stats`, also
    when the tokenizer comes from the cache): BPE training costs the square of a text's longest unbroken run, hours
    for one 10 MB row, and a caller's `max_chars` is longer than anything it trains on (`tokenizer_max_chars`).
    The first process that needs the tokenizer trains it under its lock; the others wait, then load it.
    """
    directory = trained_tokenizer_dir(cache_dir, data_fingerprint, vocab_size, kind, max_chars)
    with preparation_lock(cache_dir, f"tokenizer-{directory.name}", "the tokenizer"):
        trained = not (directory / "tokenizer_config.json").is_file()
        if trained:
            _train_into(directory, texts, vocab_size, kind, max_chars)
        record = directory / TOKENIZER_STATS
        left_out = json.loads(record.read_text()).get("texts_overlong", 0) if record.is_file() else 0
    if stats is not None and left_out:
        stats["tokenizer_texts_overlong"] = left_out
    return AutoTokenizer.from_pretrained(directory), trained


def _train_into(directory: Path, texts, vocab_size: int, kind: str, max_chars: int | None) -> None:
    left_out = 0

    def bounded(texts):
        nonlocal left_out
        for text in texts:
            if max_chars is None or len(text) <= max_chars:
                yield text
            else:
                left_out += 1

    tokenizer = TRAINERS[kind](bounded(texts()), vocab_size)
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    save_tokenizer(tokenizer, tmp)
    (tmp / TOKENIZER_STATS).write_text(json.dumps({"texts_overlong": left_out, "max_chars": max_chars}))
    try:
        tmp.rename(directory)
    except OSError:  # another process finished first; its files are identical
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_max_chars(max_tokens: int) -> int:
    """The longest text a locally trained tokenizer learns from, for data whose longest trained sequence holds
    `max_tokens` tokens: longer ones cannot fit (every token of a trained chat tokenizer spells at most
    `MAX_TOKEN_CHARS` characters), so what training sees of them is truncated or nothing. For WordPiece, which drops
    whitespace and reads words over 100 characters as one unknown token, it is a generous estimate, not a proof."""
    return max_tokens * MAX_TOKEN_CHARS


def text_pieces(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Texts longer than `max_chars` cut into pieces of at most that many characters, each cut before a space or line
    break where there is one, so the pre-tokenizer splits the pieces as it splits the whole: for pretraining, whose
    long documents are trained on whole (in rows), and whose tokenizer must learn from all of them."""
    for text in texts:
        start = 0
        while len(text) - start > max_chars:
            end = max(text.rfind(c, start + 1, start + max_chars + 1) for c in " \n")
            end = end if end > start else start + max_chars
            yield text[start:end]
            start = end
        yield text[start:]


def config_tokenizer(
    config, cache_dir, data_fingerprint: str, texts, built: list, log, kind: str = "chat", *, max_tokens: int,
    stats: dict,
):  # fmt: skip
    """The tokenizer a recipe config asks for: `tokenizer_name_or_path` or the model's, else one trained on
    `texts()` (once; cached by `data_fingerprint`, see `load_or_train_tokenizer`). Adds "tokenizer" to `built`
    when it trained one; `max_tokens` is the longest sequence a text of `texts()` can be trained in, and `stats`
    receives the count of texts left out of training as longer than anything trainable."""
    if config.tokenizer_name_or_path:
        return load_tokenizer(config.tokenizer_name_or_path, config.trust_remote_code)
    if config.model_name_or_path:
        return load_tokenizer(config.model_name_or_path, config.trust_remote_code, config.model_revision)
    max_chars = tokenizer_max_chars(max_tokens)
    tokenizer, trained = load_or_train_tokenizer(
        cache_dir, data_fingerprint, texts, config.tokenizer_vocab_size, kind, max_chars, stats
    )
    if trained:
        built.append("tokenizer")
    what = "WordPiece" if kind == "encoder" else "BPE"
    log.info(
        "%s a %d-token %s tokenizer on the training data", "Trained" if trained else "Reusing", len(tokenizer), what
    )
    if stats.get("tokenizer_texts_overlong"):
        log.warning(
            "Tokenizer training left out %d text(s) longer than %d characters: no example holding one fits in %d "
            "tokens (tokenizer_texts_overlong in the data stats)",
            stats["tokenizer_texts_overlong"], max_chars, max_tokens,
        )  # fmt: skip
    return tokenizer


def load_tokenizer(
    name_or_path: str, trust_remote_code: bool = False, revision: str | None = None
) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained` with a readable error for a missing path or an offline Hub name; a `pip:`
    name loads the model an installed package holds (`tunebook.models.gguf.resolve_model_name`)."""
    from .gguf import resolve_model_name

    name_or_path = resolve_model_name(name_or_path)
    if looks_like_local_path(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise ModelError(f"tokenizer path not found: {name_or_path}")
    if Path(name_or_path).expanduser().is_file():
        raise ModelError(f"{name_or_path} is a file, not a tokenizer directory (a folder with tokenizer_config.json) "
                         "or a Hub name")  # fmt: skip
    try:
        kwargs = {"revision": revision} if revision else {}
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        kind = "directory" if looks_like_local_path(name_or_path) else "Hub name"
        raise ModelError(f"could not load a tokenizer from {kind} '{name_or_path}': {first_line(e)}") from None
    if tokenizer.pad_token is None:
        # Padding positions are masked out of attention and loss, so any existing token serves; a tokenizer with no
        # EOS either gets a pad token of its own (the model's embeddings grow by its row, see models.build).
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def setup_chat_template(tokenizer, chat_template: str | None, trust_remote_code: bool, log) -> PreTrainedTokenizerBase:
    """The chat recipes' tokenizer: with `chat_template` (Jinja text, a .jinja file, or a tokenizer directory or Hub
    name to take it from), or its own, or else ChatML with `<|im_start|>`/`<|im_end|>` added as special tokens.

    Then the model must learn to stop: the token that ends an assistant turn in the template becomes `eos_token`
    (the model's other EOS ids are kept in its generation config, see `tunebook.models.build`). A template whose
    assistant turns end without any special token is refused: a model trained on it never learns to stop.
    """
    if chat_template:
        tokenizer.chat_template = _template_text(chat_template, trust_remote_code)
        log.info("Chat template from chat_template (%s)", _shorten(chat_template))
    elif tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE
        added = tokenizer.add_special_tokens(
            {"extra_special_tokens": ["<|im_start|>", "<|im_end|>"]}, replace_extra_special_tokens=False
        )
        log.info(
            "The tokenizer has no chat template: using ChatML (%d marker token(s) added to the vocabulary)", added
        )
    end_of_turn = _end_of_turn_token(tokenizer)
    if end_of_turn != tokenizer.eos_token:
        old = tokenizer.eos_token
        # The old EOS stays a special token (skipped when decoding); generate() still stops at it too.
        if old is not None:
            tokenizer.add_special_tokens({"extra_special_tokens": [old]}, replace_extra_special_tokens=False)
        if old is not None and isinstance(tokenizer.chat_template, str) and "eos_token" in tokenizer.chat_template:
            # Templates that close a conversation with eos_token (Phi-3, Phi-4-mini: "<|end|>\n<|endoftext|>") keep
            # rendering the model's own EOS there, not the end-of-turn token it becomes ("<|end|>\n<|end|>").
            tokenizer.chat_template = "{%- set eos_token = " + json.dumps(old) + " %}" + tokenizer.chat_template
        tokenizer.eos_token = end_of_turn
        log.info("eos_token is now %r, the end of an assistant turn in the chat template (was %r)", end_of_turn, old)
    return tokenizer


def _template_text(value: str, trust_remote_code: bool) -> str:
    from ..errors import ConfigError

    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if value.endswith(".jinja"):
        raise ConfigError(f"chat_template file not found: {value}")
    if looks_like_local_path(value) and not path.exists():
        raise ConfigError(f"chat_template: {value} is neither Jinja text, a .jinja file nor a tokenizer directory")
    source = load_tokenizer(value, trust_remote_code)
    if not source.chat_template or not isinstance(source.chat_template, str):
        raise ConfigError(f"chat_template: the tokenizer at {value} has no (single) chat template")
    return source.chat_template


def _shorten(value: str) -> str:
    value = " ".join(value.split())
    return value if len(value) <= 60 else value[:57] + "..."


def _end_of_turn_token(tokenizer) -> str:
    """The first special token after an assistant message's text in the template's rendering."""
    from ..errors import ConfigError

    answer = "Tunebook answer 42."
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "A question?"}, {"role": "assistant", "content": answer}], tokenize=False
        )
    except Exception as error:
        raise ConfigError(
            f"the chat template cannot render a user and an assistant turn: {first_line(error)}"
        ) from None
    if answer not in text:
        raise ConfigError("the chat template does not render the assistant's message text")
    after = text[text.rindex(answer) + len(answer) :]
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    found = [(after.find(t), t) for t in specials if t and after.find(t) >= 0]
    if not found:
        raise ConfigError(
            f"the chat template ends an assistant turn with {after!r}, which holds no special token: a model trained "
            f"on it never learns to stop. Use a template that ends turns with eos_token ({tokenizer.eos_token!r}) "
            "or another special token"
        )
    return min(found, key=lambda f: (f[0], -len(f[1])))[1]
