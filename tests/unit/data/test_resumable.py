"""One interface for the loop's questions to its training loader, map-style or streamed (`tunebook.data.resumable`)."""

from __future__ import annotations

import pytest
from accelerate import Accelerator

from tunebook.config import SFTConfig
from tunebook.data.collate import PadCollator
from tunebook.data.loaders import fixed_batch_shape, train_and_eval_loaders
from tunebook.data.resumable import MapLoader, ResumableLoader, resumable
from tunebook.data.stream import StreamLoader, TokenStream

ROWS = [{"input_ids": [5] * n, "labels": [5] * n} for n in (3, 7, 4, 6)]


def _config(**overrides) -> SFTConfig:
    return SFTConfig(max_steps=3, max_seq_length=16, dataloader_num_workers=0, dataloader_pin_memory=False,
                     per_device_train_batch_size=2, torch_compile=False, **overrides)  # fmt: skip


def _never_opened():
    raise AssertionError("the interface's answers read no data")


def test_a_map_style_loader_does_not_stream_and_its_position_is_the_runs():
    collate = PadCollator(0)
    train, _ = train_and_eval_loaders(_config(), ROWS, None, collate)
    prepared = Accelerator(cpu=True).prepare(train)  # Accelerate's own loader class, which carries no method of ours
    for loader in (train, prepared):
        answers = resumable(loader)
        assert isinstance(answers, MapLoader) and not answers.streams
        assert answers.state_dict() is None and answers.source_names == []
        assert answers.delivered(None) == {} and answers.examples_read(None) == {}
        assert answers.collate is collate
        answers.load_state_dict(None)
        with pytest.raises(ValueError, match="keeps no position of its own"):
            answers.load_state_dict({"taken": 3})
    assert len(list(prepared)) == 2  # still iterated as it was


def test_a_stream_loader_is_its_own_interface_and_keeps_its_position():
    stream = TokenStream(_never_opened, None, group=8, batch_size=2, process_index=0, num_processes=1,
                         source_names=["web", "books"])  # fmt: skip
    collate = PadCollator(0)
    loader, evaluation = train_and_eval_loaders(_config(), stream, None, collate)
    assert isinstance(loader, StreamLoader) and isinstance(loader, ResumableLoader) and evaluation is None
    assert resumable(loader) is loader and loader.streams
    assert loader.source_names == ["web", "books"] and loader.collate is collate is stream.collate
    state = loader.state_dict()
    assert state == {"workers": 1, "taken": 0, "tokens": [0, 0], "examples": [0, 0, 0, 0], "positions": {}}
    loader.load_state_dict({**state, "taken": 5, "positions": {"0": {"epoch": 1}}})
    assert loader.taken == 5 and loader.positions == {0: {"epoch": 1}}
    assert fixed_batch_shape(loader) is None  # padded rows: no one shape


def test_the_interface_asks_for_every_answer():
    class Partial(ResumableLoader):
        streams = True

    with pytest.raises(TypeError, match="abstract"):
        Partial()
