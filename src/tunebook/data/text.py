"""Plain text for continued pretraining: documents -> tokens + EOS -> rows of `max_seq_length`, cached.

Documents are concatenated in order, each ended by the EOS token, and cut into rows of exactly `max_seq_length`
tokens (the last may be shorter). A row records the document pieces it holds (`seq_lengths`), so attention stays
inside each document exactly as for packed SFT rows (`PackedCollator` + `attention_inputs`), and the first token
of every piece carries no label: nothing before it in its document is visible to predict it from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from ..errors import ConfigError, DataError
from ..models.tokenizer import text_pieces, tokenizer_max_chars
from .cache import PREPROCESSING_VERSION, fingerprint, tokenizer_fingerprint
from .packing import example_lengths
from .pipeline import Pipeline, PreparedData, Tokenised
from .sources import DataSource, fingerprint_sources, load_source, raise_unless_text
from .stream import (
    Mixture,
    TextRows,
    TokenStream,
    prepared_tokenizer,
    process_position,
    source_names,
    stream_fingerprint,
)
from .synthetic import write_synthetic_text
from .tokenize import IGNORE_INDEX

__all__ = ["TextData", "TextPipeline", "chunk_documents", "prepare_text_data"]

TOKENIZER_DOCUMENTS = 20_000  # a tokenizer trained on a streamed corpus learns from its first documents
STREAM_DOCUMENTS = 256  # documents a streamed reader tokenises at a time (a resumed reader reads them again)


@dataclass(kw_only=True)
class TextData(PreparedData):
    """The prepared data of a continued-pretraining run: rows of input_ids, labels, seq_lengths."""


def chunk_documents(documents: Iterator[list[int]], max_seq_length: int) -> Iterator[dict[str, list[int]]]:
    """Rows of `max_seq_length` tokens cut from the concatenated documents, with their pieces' lengths."""
    ids: list[int] = []
    lengths: list[int] = []
    for doc in documents:
        pos = 0
        while pos < len(doc):
            take = min(len(doc) - pos, max_seq_length - len(ids))
            ids.extend(doc[pos : pos + take])
            lengths.append(take)
            pos += take
            if len(ids) == max_seq_length:
                yield _row(ids, lengths)
                ids, lengths = [], []
    if ids:
        yield _row(ids, lengths)


def _row(ids: list[int], lengths: list[int]) -> dict[str, list[int]]:
    labels = list(ids)
    start = 0
    for n in lengths:
        labels[start] = IGNORE_INDEX
        start += n
    return {"input_ids": ids, "labels": labels, "seq_lengths": lengths}


def prepare_text_data(config, cache_dir: Path, log: logging.Logger) -> TextData:
    """`config` is a `PretrainConfig`. In multi-process runs call it through `tunebook.distributed.prepare_then_join`."""
    return TextPipeline(config, cache_dir, log).prepare()


class TextPipeline(Pipeline):
    """Continued pretraining's steps: documents tokenised, ended by EOS and cut into rows; held out a document at a
    time before they are cut (`eval_split_ratio`), so both splits' rows are cached under their own keys."""

    streams = True
    write_synthetic = staticmethod(write_synthetic_text)

    def documents(self, sources: list[DataSource]) -> datasets.Dataset:
        config, parts = self.config, []
        for source in sources:
            raw = load_source(source, self.cache_dir, config.seed, config.text_sample_by)
            if config.text_column not in raw.column_names:
                raise DataError(f"{source.where}: no column {config.text_column!r} (columns: "
                                f"{', '.join(raw.column_names)}); set text_column")  # fmt: skip
            raise_unless_text(raw, config.text_column, source.where)
            parts.append(raw.select_columns([config.text_column]))
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

    def make_tokenizer(self, mixture: Mixture | None = None):
        """Trained on the documents (the first of a stream's), unless the config names one; prepared shards
        (tunebook prepare --output) come with theirs."""
        config = self.config
        if mixture is not None:
            read = lambda: (row[config.text_column] for row in mixture().take(TOKENIZER_DOCUMENTS))  # noqa: E731
            data_key = stream_fingerprint(self.train_sources, config.text_sample_by)
        else:
            read = lambda: iter(self.documents(self.train_sources)[config.text_column])  # noqa: E731
            data_key = fingerprint_sources(self.train_sources)
        # Documents are trained on whole, however long (cut into rows): the tokenizer learns from all of each, in
        # pieces short enough that no piece is left out and none costs tokenizer training more than a row's worth of
        # text. So no text is left out: the notes stay empty and are not reported.
        texts = lambda: text_pieces(read(), tokenizer_max_chars(config.max_seq_length))  # noqa: E731
        tokenizer = mixture is not None and prepared_tokenizer(self.train_sources, config, "pretrain")
        tokenizer = tokenizer or self.trained_tokenizer(data_key, texts, config.max_seq_length)
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no EOS token to end documents with; set tokenizer_name_or_path")
        return tokenizer

    def tokenise(self, sources: list[DataSource], name: str) -> Tokenised:
        """Rows of `sources`; when eval data is held out of the train data, each split's documents only."""
        return self.rows(sources, name, name if self.holds_out else None)

    def rows(self, sources: list[DataSource], name: str, split: str | None) -> Tokenised:
        config, tokenizer = self.config, self.tokenizer
        key = fingerprint(
            {
                "sources": fingerprint_sources(sources),
                "tokenizer": tokenizer_fingerprint(tokenizer),
                "text": [config.text_column, config.text_sample_by],
                "max_seq_length": config.max_seq_length,
                "split": [config.eval_split_ratio, config.seed, split] if split else None,
                "seed": config.seed if any(s.weight != 1.0 or s.samples is not None for s in sources) else None,
                "version": f"text-{PREPROCESSING_VERSION}",
            }
        )

        def build(scratch: Path):
            docs = self.documents(sources).map(
                lambda batch: {"ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(
                    batch[config.text_column], add_special_tokens=False)["input_ids"]]},
                batched=True, remove_columns=[config.text_column], num_proc=config.dataset_num_proc,
                cache_file_name=str(scratch / "tokenised.arrow"), desc=f"Tokenising {name}",
            )  # fmt: skip
            if split:  # a seeded document-level split of train_data (eval_split_ratio)
                order = np.random.default_rng(config.seed).permutation(len(docs))
                n_eval = max(1, int(round(config.eval_split_ratio * len(docs))))
                if n_eval >= len(docs):
                    raise ConfigError(f"eval_split_ratio={config.eval_split_ratio} leaves no training documents")
                docs = docs.select(np.sort(order[:n_eval] if split == "eval" else order[n_eval:]))

            def stream() -> Iterator[list[int]]:
                for begin in range(0, len(docs), 1000):  # batches of documents: memory stays flat
                    yield from docs[begin : begin + 1000]["ids"]

            chunked = datasets.Dataset.from_generator(
                lambda: chunk_documents(stream(), config.max_seq_length), cache_dir=str(scratch / "rows")
            )
            return chunked, {"documents": len(docs), "rows": len(chunked)}

        dataset, stats, cached = self.cached(key, build, f"{name} tokenisation")
        self.log.info("%s data: %d documents in %d rows of %d tokens (%s)", name, stats["documents"], stats["rows"],
                      config.max_seq_length, "from cache" if cached else "tokenised and cached")  # fmt: skip
        return Tokenised(dataset, key, stats)

    def split(self, train: Tokenised) -> tuple[Tokenised, Tokenised]:
        return train, self.tokenise(self.train_sources, "eval")  # the held-out documents' rows

    def finish(self, train: Tokenised, evaluation: Tokenised | None) -> TextData:
        stats = train.stats
        stats["train_tokens_per_epoch"] = int(example_lengths(train.dataset).sum())
        return TextData(tokenizer=self.tokenizer, train=train.dataset, eval=evaluation and evaluation.dataset,
                        stats=stats)  # fmt: skip

    def streamed(self) -> TextData:
        """Rows made in the loader's workers as training reads them: nothing is cached."""
        config, train_sources = self.config, self.train_sources
        mixture = Mixture(train_sources, config.text_column, config.seed, config.mixture_stopping_strategy,
                          config.text_sample_by)  # fmt: skip
        self.tokenizer = self.make_tokenizer(mixture)
        rows_of = TextRows(self.tokenizer, config.max_seq_length, config.text_column, len(train_sources))
        stream = TokenStream(mixture, rows_of, STREAM_DOCUMENTS, config.per_device_train_batch_size,
                             *process_position(), source_names(train_sources),
                             config.seed if config.stream_shuffle else None)  # fmt: skip
        stream.check_readers(config.dataloader_num_workers, self.log)
        eval_rows = self.rows(self.eval_sources, "eval", None).dataset if self.eval_sources else None
        stats = {"streamed": True, "sources": source_names(train_sources)}
        how = "prepared rows" if mixture.prepared else "tokenised and cut into rows as training reads it"
        self.log.info("train data: streamed from %s, %s of %d tokens", ", ".join(stats["sources"]), how,
                      config.max_seq_length)  # fmt: skip
        return TextData(tokenizer=self.tokenizer, train=stream.preview(), eval=eval_rows, stats=stats, stream=stream)
