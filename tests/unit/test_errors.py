"""User errors stay one line: a TunebookError raised in a DataLoader worker (an image that no longer decodes) reaches
the training process with its own message, not torch's re-raise of the worker's whole traceback."""

from __future__ import annotations

import pytest
import torch

from tunebook.errors import DataError


def _fail(rows):
    raise DataError(f"train.jsonl, row {rows[0] + 1}, image 1 (a.png): could not be read: image file is truncated")


def test_an_error_from_a_loader_worker_keeps_its_one_line():
    loader = torch.utils.data.DataLoader(range(4), batch_size=2, num_workers=1, collate_fn=_fail)
    with pytest.raises(DataError) as error:
        next(iter(loader))
    assert str(error.value) == "train.jsonl, row 1, image 1 (a.png): could not be read: image file is truncated"
    assert "Traceback" in error.value.worker_traceback  # kept aside, for whoever debugs the worker


def test_other_messages_are_kept_as_given():
    assert str(DataError("Caught nothing: a message of its own\nsecond line")) == (
        "Caught nothing: a message of its own\nsecond line"
    )
    assert DataError("a", "b").args == ("a", "b")
