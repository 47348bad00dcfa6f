"""The progress bar every loop shows (training, evaluation, generation): below the packages that draw one."""

from __future__ import annotations

__all__ = ["progress_bar"]


def progress_bar(main_process: bool, disable: bool, **kwargs):
    """A tqdm bar on the main process only; off with `disable` (disable_tqdm) and when stderr is not a terminal."""
    from tqdm.auto import tqdm

    # tqdm's disable=None means: off when the output is not a TTY.
    return tqdm(disable=True if disable or not main_process else None, dynamic_ncols=True, **kwargs)
