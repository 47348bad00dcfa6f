"""Reward functions for the GRPO tests: what a user's file passed as `path/to/file.py:function` looks like."""

import sys


def text_length(prompts, completions, **columns):
    """Random completions differ in length, so their advantages, and the updates, are not zero."""
    return [len(c) / 10 for c in completions]


def uses_the_columns(prompts, completions, answer, completion_lengths, **columns):
    """Checks what reaches a reward function: the prompt as the data has it, and each row's other columns."""
    assert len(prompts) == len(completions) == len(answer) == len(completion_lengths)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def raises(prompts, completions, **columns):
    raise KeyError("solution")


def too_few(prompts, completions, **columns):
    return [0.0]


def exits(prompts, completions, **columns):
    sys.exit(3)  # SystemExit passes `except Exception`: it must not end the run with this code and no word


def picture_shows_the_answer(prompts, completions, images, answer, **columns):
    """1 where a completion's `images` are its own prompt's: the picture holds the colour its answer names (the
    shapes task; another prompt's picture holds it 1 time in 6)."""
    from PIL import Image

    from tunebook.data.synthetic import SHAPE_COLOURS

    assert len(images) == len(completions) and all(len(paths) == 1 for paths in images)
    shown = []
    for paths, colour in zip(images, answer):
        with Image.open(paths[0]) as picture:
            shown.append(float(SHAPE_COLOURS[colour] in {c for _, c in picture.convert("RGB").getcolors(1 << 16)}))
    return shown
