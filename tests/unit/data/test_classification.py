"""Classification data and models in the shapes users bring: float labels, tokenizers that pad on the left, fresh
encoders whose embeddings keep a padding row. Every example's logits in a padded batch equal its logits alone."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import DataCollatorWithPadding

from tunebook.config import ClassifyConfig
from tunebook.data import prepare_classification_data
from tunebook.errors import ConfigError, DataError
from tunebook.models import build_sequence_classifier

TEXTS = ["a short one", "a much longer text that goes on and on about the weather and the sea", "mid length text"]
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def _data(tmp_path, labels, **config):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in zip(TEXTS * 4, labels)))
    config = ClassifyConfig(train_data=str(path), eval_data=str(path), output_dir=str(tmp_path / "out"), **config)
    return prepare_classification_data(config, tmp_path / "cache", logging.getLogger("test"))


def test_whole_float_labels_are_class_ids_and_fractions_stop_with_the_row(tmp_path):
    data = _data(tmp_path, [0.0, 1.0, 2.0] * 4)
    assert data.label_names == ["0", "1", "2"] and data.train["labels"][:3] == [0, 1, 2]
    with pytest.raises(DataError, match=r"train.jsonl, row 2: label 0.5 in column 'label' is not a whole number"):
        _data(tmp_path / "b", [1.0, 0.5, 2.0] * 4)


def _padded_equals_alone(model, data):
    rows = [{k: v for k, v in data.train[i].items() if k != "labels"} for i in range(3)]
    batch = DataCollatorWithPadding(data.tokenizer)(rows)
    assert batch["attention_mask"].min() == 0, "the batch must hold padding for the test to mean anything"
    with torch.no_grad():
        padded = model(**batch).logits
        for i, row in enumerate(rows):
            alone = model(**{k: torch.tensor([v]) for k, v in row.items()}).logits[0]
            torch.testing.assert_close(padded[i], alone, atol=1e-5, rtol=1e-5)


def test_a_tokenizer_that_pads_on_the_left_pads_on_the_right_for_absolute_positions(tmp_path, monkeypatch):
    """GPT-2 and BERT count positions from the row's start: left padding (as chat tokenizers ship) would shift them
    for every shorter example, in training and in evaluation alike."""
    import tunebook.data.pipeline as pipeline

    config_tokenizer = pipeline.config_tokenizer

    def left_padding(*args, **kwargs):
        tokenizer = config_tokenizer(*args, **kwargs)
        tokenizer.padding_side = "left"
        return tokenizer

    monkeypatch.setattr(pipeline, "config_tokenizer", left_padding)
    data = _data(tmp_path, ["x", "y", "z"] * 4)
    assert data.tokenizer.padding_side == "right"
    for model_type in ("gpt2", "bert"):
        torch.manual_seed(0)
        model = build_sequence_classifier(data.tokenizer, data.label_names,
                                          model_config={"model_type": model_type, **TINY}).eval()  # fmt: skip
        _padded_equals_alone(model, data)


@pytest.mark.parametrize("model_type", ["roberta", "opt", "modernbert", "phi3"])
def test_a_fresh_model_pads_with_the_tokenizers_pad_token(tmp_path, model_type):
    """RoBERTa's and OPT's default padding id (1) is the trained tokenizer's [UNK], whose row would never train
    (and RoBERTa's positions would restart at it); ModernBERT's and Phi-3's lie outside a small vocabulary."""
    data = _data(tmp_path, ["x", "y", "z"] * 4)
    torch.manual_seed(0)
    model = build_sequence_classifier(data.tokenizer, data.label_names,
                                      model_config={"model_type": model_type, **TINY}).eval()  # fmt: skip
    assert model.get_input_embeddings().padding_idx == data.tokenizer.pad_token_id
    _padded_equals_alone(model, data)


def test_a_model_whose_padding_row_is_fixed_elsewhere_stops_with_one_line(tmp_path):
    data = _data(tmp_path, ["x", "y", "z"] * 4)
    with pytest.raises(
        ConfigError, match=r"mpnet's .* treats token id 1 as padding, but the tokenizer pads with id 0"
    ):
        build_sequence_classifier(data.tokenizer, data.label_names, model_config={"model_type": "mpnet", **TINY})


def test_an_architecture_without_sdpa_names_the_config_key(tmp_path):
    data = _data(tmp_path, ["x", "y", "z"] * 4)
    with pytest.raises(
        ConfigError, match=r"model_config: .*\(config key attn_implementation, e.g. --attn_implementation"
    ):
        build_sequence_classifier(data.tokenizer, data.label_names, model_config={"model_type": "deberta-v2", **TINY},
                                  attn_implementation="sdpa")  # fmt: skip


def test_a_tokenizer_with_neither_pad_nor_eos_gets_a_pad_token(tmp_path):
    """Before, the first padded batch failed in transformers' collator ("Asking to pad but the tokenizer does not have
    a padding token")."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainer=trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tokenizer")
    data = _data(tmp_path, ["x", "y", "z"] * 4, tokenizer_name_or_path=str(tmp_path / "tokenizer"))
    assert data.tokenizer.pad_token == "<|pad|>" and data.tokenizer.eos_token is None
    torch.manual_seed(0)
    model = build_sequence_classifier(data.tokenizer, data.label_names,
                                      model_config={"model_type": "bert", **TINY}).eval()  # fmt: skip
    assert model.get_input_embeddings().padding_idx == data.tokenizer.pad_token_id
    _padded_equals_alone(model, data)
