"""Opt-in checks on the real data sets in ../shared/data (skipped where they are absent)."""

from __future__ import annotations

import logging

import pytest
from support import ROOT

from tunebook.config import SFTConfig, parse_config
from tunebook.data import prepare_sft_data

CODE_ALPACA = ROOT.parent / "shared" / "data" / "code_alpaca_2k" / "code_alpaca_2k.json"


@pytest.mark.skipif(not CODE_ALPACA.is_file(), reason="../shared/data is not beside the checkout")
def test_alpaca_data_packs_at_least_97_percent_full_at_512(tmp_path):
    config = parse_config(
        SFTConfig,
        overrides={"train_data": str(CODE_ALPACA), "packing": True, "max_seq_length": 512,
                   "tokenizer_vocab_size": 2048},
    )  # fmt: skip
    data = prepare_sft_data(config, tmp_path, logging.getLogger("test"))
    assert data.stats["examples_packed"] == data.stats["examples_kept"] > 2000
    assert data.stats["packing_efficiency"] >= 0.97
    assert not list((tmp_path / "tmp").iterdir())  # scratch files of the build are gone
