"""Supervised fine-tuning data of a vision-language model: sources with images -> rows in one form with image
references (`tunebook.data.images`) -> every image's size read from its header (`check_images`) -> tokenised and
loss-masked with the processor and blank images of those sizes (`tunebook.data.vision_tokenize`) -> cached.

The cached rows hold `input_ids`, `labels`, `prompt_length`, the image references (paths or bytes, never pixels),
their sizes and `where` (the row's file and row); the collator (`tunebook.data.vision_collate`) decodes the images
in the DataLoader's workers. The cache key covers the data files, the processor (tokenizer, chat template, image
processor settings) and the image references with their sizes as read now: a replaced image is tokenised again.

`prepare_sft_or_vision_data` is what `recipes/sft.py` and `tunebook prepare --recipe sft` call: this path when the
model is a vision-language model, the text path otherwise.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import datasets
import numpy as np

from ..config.tiny import TINY_QWEN2_VL
from ..errors import ConfigError, DataError
from ..locations import PACKAGE_PREFIX, package_model
from ..models.build import read_model_config
from ..models.tokenizer import setup_chat_template
from ..models.vision import is_vision_language_model, load_processor, tiny_processor
from .cache import fingerprint
from .images import IMAGE_COLUMNS, check_images, read_image_source
from .packing import example_lengths
from .pipeline import Pipeline, PreparedData, Tokenised
from .pixel_cache import add_pixel_values, image_files_fingerprint
from .sft import SFTData, held_out_split, pack_cached, prepare_sft_data
from .sources import DataSource, fingerprint_sources, parse_sources
from .synthetic import write_synthetic_image_task
from .vision_tokenize import images_fingerprint, processor_fingerprint, tokenise_cached, tokenize_image_conversations

__all__ = [
    "VISION_FEATURES",
    "prepare_sft_or_vision_data",
    "prepare_vision_sft_data",
    "set_resize_bounds",
    "uses_images",
    "vision_processor",
]

# What a packed row keeps beside its tokens: the images of its examples in row order, and how many each has.
PACKED_IMAGE_COLUMNS = ("images", "where")
VISION_VERSION = "1"  # bump when vision tokenisation or masking changes what it produces
_SIZES = datasets.List(datasets.List(datasets.Value("int32")))
VISION_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "labels": datasets.List(datasets.Value("int64")),
    "prompt_length": datasets.Value("int64"),
    "truncated": datasets.Value("bool"),
    "image_cut": datasets.Value("bool"),
    "keep": datasets.Value("bool"),
    "where": datasets.Value("string"),
    # Plain structs, not datasets.Image: `save_to_disk` would embed every image file's bytes into the cache (and
    # keep its base name only), so a replaced file would train from its old bytes. A reference is kept as is.
    "images": datasets.List({"bytes": datasets.Value("binary"), "path": datasets.Value("string")}),
    "image_sizes": _SIZES,
})  # fmt: skip


def uses_images(config, log: logging.Logger | None = None) -> bool:
    """Whether `recipes/sft.py` takes the vision path: its model is a vision-language model. A train_data file
    whose first row has images, given a text-only model, is a ConfigError (a text model cannot see them); given no
    model at all (the recipe's tiny text default), the tiny default becomes a Qwen2-VL (`TINY_QWEN2_VL`, as
    recipes/configs/sft/vlm_default.yaml builds) and `config.model_config` says so."""
    default = config.model_name_or_path is None and config.model_config == dict(config.tiny_model)
    model = config.model_name_or_path or config.model_config
    if config.model_name_or_path is None and isinstance(model, str):  # a config file: read as the model build reads it
        model = read_model_config(model)
    if isinstance(model, str) and model.startswith(PACKAGE_PREFIX):  # pip:: a folder, or a GGUF file (text only)
        folder = package_model(model)
        model = str(folder) if folder.is_dir() else None
    if model is not None and is_vision_language_model(model, config.trust_remote_code, config.model_revision):
        return True
    for path in _local_files(config.train_data):
        column = _image_column(path)
        if column and default:  # no model named: the offline default, one that sees images
            config.model_config = dict(TINY_QWEN2_VL)
            if log is not None:
                log.info("train_data %s has images and no model is named: a tiny Qwen2-VL built from a config", path)
            return True
        if column:
            name = config.model_name_or_path or f"model_config ({_model_type(config.model_config)})"
            raise ConfigError(f"train_data {path} has images (column {column!r}), and {name} is not a "
                              "vision-language model (AutoModelForImageTextToText): set model_name_or_path to one, "
                              "or model_config to a qwen2_vl, qwen2_5_vl or llava config, or neither (a tiny "
                              "Qwen2-VL)")  # fmt: skip
    return False


def _model_type(model_config) -> str:
    return model_config.get("model_type", "?") if isinstance(model_config, dict) else str(model_config)


def _local_files(spec) -> list[Path]:
    try:
        sources = parse_sources(spec, "train_data")
    except (ConfigError, DataError):
        return []  # the preparation reports it, as it does for a text model
    paths = [Path(s.path).expanduser() for s in sources if s.is_local and not s.streaming]
    return [p for p in paths if p.is_file() and p.suffix in (".jsonl", ".json")]


def _image_column(path: Path) -> str | None:
    """The image column of a JSON Lines file's first row (read alone: nothing else is loaded), or None."""
    try:
        with path.open(encoding="utf-8") as f:
            row = json.loads(f.readline() or "{}")
    except (OSError, ValueError):
        return None
    return next((c for c in IMAGE_COLUMNS if isinstance(row, dict) and row.get(c)), None)


def prepare_sft_or_vision_data(config, cache_dir: Path, log: logging.Logger) -> SFTData:
    """What `recipes/sft.py` and `tunebook prepare --recipe sft` prepare: a vision-language model's data with images
    (`uses_images`; `data.processor` set), else the text path's (`prepare_sft_data`)."""
    return (prepare_vision_sft_data if uses_images(config, log) else prepare_sft_data)(config, cache_dir, log)


def prepare_vision_sft_data(config, cache_dir: Path, log: logging.Logger) -> SFTData:
    """Sources -> processor -> checked images -> tokenised train and eval sets (cached); `data.processor` is the
    processor, `data.tokenizer` its tokenizer. Call through `prepare_then_join` in multi-process runs."""
    return VisionSFTPipeline(config, cache_dir, log).prepare()


def set_resize_bounds(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Qwen-style resize bounds (`min_pixels`/`max_pixels`: the image as resized holds between them) on the image
    processor, which keeps them as `size` {shortest_edge, longest_edge} in pixels (transformers 5)."""
    if min_pixels is None and max_pixels is None:
        return
    images = processor.image_processor
    size = dict(getattr(images, "size", None) or {})
    if "longest_edge" not in size or "shortest_edge" not in size or not hasattr(images, "merge_size"):
        raise ConfigError(f"min_pixels/max_pixels: {type(images).__name__} resizes every image to a fixed size, it "
                          "takes no pixel bounds (Qwen-VL's image processors do); remove them")  # fmt: skip
    if min_pixels is not None:
        size["shortest_edge"] = min_pixels
    if max_pixels is not None:
        size["longest_edge"] = max_pixels
    if size["shortest_edge"] > size["longest_edge"]:
        raise ConfigError(f"min_pixels {size['shortest_edge']} is more than max_pixels {size['longest_edge']}")
    images.size = size


def vision_processor(pipeline: Pipeline, texts, max_tokens: int | None = None):
    """The processor of a pipeline's vision-language model (`pipeline.config`): loaded with model_name_or_path, or
    for a fresh model the family's, around a tokenizer trained on `texts()` (or named) as the text path's is
    (`max_tokens`: the longest text to train on, max_seq_length unless given); resize bounds and chat template set."""
    config = pipeline.config
    if config.model_name_or_path:
        processor = load_processor(config.model_name_or_path, config.trust_remote_code, config.model_revision)
    else:  # a fresh model: a tokenizer trained (or named) as the text path's, the family's image processor
        key = fingerprint_sources(pipeline.train_sources)
        tokenizer = pipeline.trained_tokenizer(key, texts, max_tokens or config.max_seq_length)
        bounds = {"max_image_pixels": config.max_pixels} if config.max_pixels else {}
        processor = tiny_processor(config.model_config, tokenizer, **bounds)
    set_resize_bounds(processor, config.min_pixels, config.max_pixels)
    tokenizer = processor.tokenizer
    if isinstance(processor.chat_template, str):  # the processor's template renders image parts
        tokenizer.chat_template = processor.chat_template
    setup_chat_template(tokenizer, config.chat_template, config.trust_remote_code, pipeline.log)  # eos: end of turn
    processor.chat_template = tokenizer.chat_template
    return processor


class VisionSFTPipeline(Pipeline):
    """SFT's steps for rows with images: the processor, images checked, tokenised with blank images, held out."""

    write_synthetic = staticmethod(write_synthetic_image_task)

    def prepare(self) -> PreparedData:
        config = self.config
        if config.split_turns:
            raise ConfigError("split_turns: true with a vision-language model: one example per turn is not supported "
                              "with images yet; set split_turns: false")  # fmt: skip
        if any(isinstance(s, dict) and s.get("streaming") for s in _listed(config.train_data)):
            raise ConfigError("train_data: streaming: true with a vision-language model is not supported yet; remove "
                              "streaming (the rows are cached, the images read in the loader's workers)")  # fmt: skip
        return super().prepare()

    def make_tokenizer(self):
        self.processor = vision_processor(self, lambda: _texts(self._read(self.train_sources)))
        return self.processor.tokenizer

    def _read(self, sources: list[DataSource]) -> datasets.Dataset:
        config = self.config
        parts = [read_image_source(s, self.cache_dir, config.seed, data_format=config.data_format,
                                   image_dir=config.image_dir, num_proc=config.dataset_num_proc)
                 for s in sources]  # fmt: skip
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        config, log = self.config, self.log
        checked = check_images(self._read(sources), on_bad_image=config.on_bad_image,
                               max_pixels=config.max_image_pixels, num_proc=config.dataset_num_proc)  # fmt: skip
        if checked.skipped:
            log.warning("%s data: %d rows skipped for a bad image (on_bad_image: skip), the first: %s", name,
                        checked.skipped, checked.first_skipped[0])  # fmt: skip
        key = fingerprint({
            "sources": fingerprint_sources(sources),
            "processor": processor_fingerprint(self.processor),
            "images": images_fingerprint(checked.dataset),
            "data_format": config.data_format,
            "image_dir": config.image_dir,
            "max_seq_length": config.max_seq_length,
            "overlong": config.overlong_examples,
            "assistant_only_loss": config.assistant_only_loss,
            # cached pixels are what the files held: a file rewritten at the same size must count as new
            "pixels": image_files_fingerprint(checked.dataset) if config.cache_pixel_values else None,
            "seed": config.seed if any(s.weight != 1.0 or s.samples is not None for s in sources) else None,
            "version": VISION_VERSION,
        })  # fmt: skip

        def build(scratch: Path):
            return _tokenised(checked.dataset, self.processor, config, key, scratch)

        dataset, stats, cached = self.cached(key, build, f"{name} tokenisation")
        stats = {**stats, "skipped_bad_image": checked.skipped}
        how = "loaded from cache, no tokenisation" if cached else "tokenised and cached"
        log.info("%s data: %d examples with images (%s); %s", name, len(dataset), how, stats)
        if stats["truncated"] or stats["dropped_overlong"] or stats["dropped_image_cut"]:
            log.warning("%s data: %d truncated and %d dropped at max_seq_length=%d, %d dropped as the cut would split "
                        "an image's tokens", name, stats["truncated"], stats["dropped_overlong"],
                        config.max_seq_length, stats["dropped_image_cut"])  # fmt: skip
        return Tokenised(dataset, key, stats)

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        kept, held = held_out_split(train.dataset, self.config.eval_split_ratio, self.config.seed)
        self.log.info("Held out %d of the training examples for evaluation (eval_split_ratio)", len(held))
        return train._replace(dataset=kept), Tokenised(held, train.key, {})

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> SFTData:
        config, stats = self.config, {**train.stats, **self.notes}
        train_rows = train.dataset
        eval_examples = eval_rows = evaluation.dataset if evaluation is not None else None
        if config.packing:  # each example's images (and cached pixels) travel with it, in their placeholders' order
            carry = PACKED_IMAGE_COLUMNS + (("pixel_inputs",) if config.cache_pixel_values else ())
            pack = functools.partial(pack_cached, config, cache_dir=self.cache_dir, built=self.built, log=self.log,
                                     carry=carry)  # fmt: skip
            train_rows, pack_stats = pack(train.dataset, train.key, self.holds_out and "train" or None, name="train")
            stats.update(pack_stats)
            if evaluation is not None:
                eval_rows, _ = pack(evaluation.dataset, evaluation.key, self.holds_out and "eval" or None, name="eval")
        if self.eval_sources:  # eval_data's rows dropped for a bad image count too (held-out rows are in the above)
            stats["eval_skipped_bad_image"] = evaluation.stats["skipped_bad_image"]
        stats["train_rows"] = len(train_rows)
        stats["train_tokens_per_epoch"] = int(example_lengths(train_rows).sum())
        return SFTData(tokenizer=self.tokenizer, processor=self.processor, train=train_rows, eval=eval_rows,
                       eval_examples=eval_examples, stats=stats)  # fmt: skip


def _listed(spec) -> list:
    return spec if isinstance(spec, list) else [spec]


def _texts(conversations: datasets.Dataset):
    """Every message's text parts with its role, to train a tokenizer on."""
    for row in conversations["conversation"]:
        for m in json.loads(row)["messages"]:
            content = m.get("content")
            parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
            yield f"{m['role']}\n" + "".join(p.get("text", "") for p in parts if p.get("type") == "text")


def _tokenised(checked: datasets.Dataset, processor, config, key: str, scratch: Path):
    tokenised = tokenise_cached(
        checked, tokenize_image_conversations, processor, VISION_FEATURES, config, key, scratch,
        "Tokenising (images as blanks of their sizes)", assistant_only_loss=config.assistant_only_loss,
    )  # fmt: skip
    keep = np.asarray(tokenised.data.column("keep"), dtype=bool)
    truncated = np.asarray(tokenised.data.column("truncated"), dtype=bool)
    image_cut = np.asarray(tokenised.data.column("image_cut"), dtype=bool)
    dropped_overlong = int((truncated & ~image_cut & ~keep).sum()) if config.overlong_examples == "drop" else 0
    stats = {
        "examples_read": len(tokenised),
        "truncated": int((truncated & keep).sum()) if config.overlong_examples == "truncate" else 0,
        "dropped_overlong": dropped_overlong,
        "dropped_image_cut": int(image_cut.sum()),
        "dropped_no_loss_tokens": int((~keep).sum()) - dropped_overlong - int(image_cut.sum()),
        "images": int(sum(len(s) for s in tokenised.data.column("image_sizes").to_pylist())),
    }
    kept = tokenised.select(np.flatnonzero(keep)).remove_columns(["keep", "truncated", "image_cut"])
    if len(kept) == 0:
        raise DataError(f"no examples with images left to train on: {stats['dropped_overlong']} longer than "
                        f"max_seq_length={config.max_seq_length} dropped, {stats['dropped_image_cut']} whose cut "
                        f"would split an image, {stats['dropped_no_loss_tokens']} with no loss-bearing token left; "
                        "raise max_seq_length or check the data")  # fmt: skip
    stats["examples_kept"] = len(kept)
    kept = kept.flatten_indices(cache_file_name=str(scratch / "kept.arrow"))
    if config.cache_pixel_values:
        kept = add_pixel_values(kept, processor, config.max_image_pixels, key, scratch, config.dataset_num_proc)
    return kept, stats
