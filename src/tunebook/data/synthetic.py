"""Generated tasks for the offline defaults and the tests: digit-string transformations (instructions), topics
(classification), topical documents (pretraining) and coloured shapes (a vision-language model's images).

Each digits example asks for one operation on a string of digits ("Reverse the digits." / "Sort the digits." on
"48213") and has one exact answer, so exact match of greedy generations measures whether fine-tuning worked:
a tiny model learns it in a couple of CPU minutes, an untrained one scores about 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = [
    "SYNTHETIC_TASKS",
    "SYNTHETIC_TOPICS",
    "make_example",
    "write_synthetic_classification",
    "write_synthetic_image_task",
    "write_synthetic_text",
    "write_synthetic_task",
]

SYNTHETIC_TASKS = {
    "Reverse the digits.": lambda s: s[::-1],
    "Sort the digits in ascending order.": lambda s: "".join(sorted(s)),
}


def make_example(rng: random.Random, min_len: int = 4, max_len: int = 7) -> dict[str, str]:
    """One Alpaca-format record: {instruction, input, output}."""
    instruction = rng.choice(list(SYNTHETIC_TASKS))
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
    return {"instruction": instruction, "input": digits, "output": SYNTHETIC_TASKS[instruction](digits)}


def write_synthetic_task(directory: str | Path, num_train: int, num_eval: int, seed: int) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` (disjoint: no eval prompt occurs in train) and return their paths.

    Deterministic for a seed; existing files with the same parameters are reused.
    """
    directory = Path(directory) / f"digits-{num_train}-{num_eval}-seed{seed}"
    return _write_disjoint(
        directory, num_train, num_eval, seed, make_example, lambda ex: (ex["instruction"], ex["input"])
    )


# The generated classification task: a sentence's topic is the one most of its topic words belong to.
SYNTHETIC_TOPICS = {
    "sports": "goal match team coach league striker referee stadium season trophy tennis sprint".split(),
    "science": "atom cell gene theory experiment physics orbit molecule laboratory fossil quantum enzyme".split(),
    "food": "bread soup recipe cheese oven spice noodle dessert garlic bakery salad butter".split(),
    "music": "guitar melody concert album rhythm singer piano chorus drummer jazz violin lyrics".split(),
}
_FILLER = (
    "the a this that yesterday today people said about with after before very quite new old big small "
    "really some many our their we they it was is were are seemed felt looked near far over under"
).split()


def make_classification_example(rng: random.Random) -> dict[str, str]:
    """One {text, label} record: filler words, three words of the label's topic and one of another topic."""
    label = rng.choice(list(SYNTHETIC_TOPICS))
    other = rng.choice([t for t in SYNTHETIC_TOPICS if t != label])
    words = [rng.choice(_FILLER) for _ in range(rng.randint(4, 9))]
    words += [rng.choice(SYNTHETIC_TOPICS[label]) for _ in range(3)] + [rng.choice(SYNTHETIC_TOPICS[other])]
    rng.shuffle(words)
    return {"text": " ".join(words), "label": label}


def write_synthetic_classification(
    directory: str | Path, num_train: int, num_eval: int, seed: int
) -> tuple[Path, Path]:
    """Write the topic task's `train.jsonl` and `eval.jsonl` (disjoint texts) and return their paths.

    Each sentence has three words of its topic and one distractor from another, among random filler, so a
    bag-of-words guess of "any topic word" scores about 75% and a model must weigh the words to do better.
    """
    directory = Path(directory) / f"topics-{num_train}-{num_eval}-seed{seed}"
    return _write_disjoint(directory, num_train, num_eval, seed, make_classification_example, "text")


def make_document(rng: random.Random) -> dict[str, str]:
    """One {text} record: 3 to 8 sentences on one topic, each a shuffled run of filler and topic words."""
    topic = rng.choice(list(SYNTHETIC_TOPICS))
    sentences = []
    for _ in range(rng.randint(3, 8)):
        words = [rng.choice(_FILLER) for _ in range(rng.randint(3, 7))]
        words += [rng.choice(SYNTHETIC_TOPICS[topic]) for _ in range(rng.randint(1, 3))]
        rng.shuffle(words)
        sentences.append(" ".join(words).capitalize() + ".")
    return {"text": " ".join(sentences)}


def write_synthetic_text(directory: str | Path, num_train: int, num_eval: int, seed: int) -> tuple[Path, Path]:
    """Write plain-text documents (`{"text": ...}` per line) for the continued-pretraining default: each keeps to
    one topic, so a model that has learnt the topics predicts the rest of a document better than word counts."""
    directory = Path(directory) / f"documents-{num_train}-{num_eval}-seed{seed}"
    return _write_disjoint(directory, num_train, num_eval, seed, make_document, "text")


# The generated image task: a picture of two or three shapes, each a different colour; the question names one shape
# (or colour) and the answer is its colour (or shape), so only a model that looks at the picture does better than
# guessing. Sizes are multiples of 28 pixels (a Qwen2-VL image token's side) and differ, so a model whose image
# token count depends on the size sees 4, 6 and 12 tokens.
SHAPE_COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 200, 30),
    "purple": (140, 60, 170),
    "orange": (245, 140, 30),
}
SHAPES = ("square", "circle", "triangle")
SHAPE_IMAGE_SIZES = ((56, 56), (84, 56), (56, 84), (112, 84))
_BACKGROUNDS = ((255, 255, 255), (235, 235, 235))
_SCALES = (0.6, 0.75, 0.9)  # of a shape's cell


def make_shapes_layout(rng: random.Random) -> tuple:
    """A picture as data: (size, background, ((cell, shape, colour, scale), ...)) on a 2 x 2 grid of cells."""
    count = rng.choice((2, 3))
    cells = sorted(rng.sample(range(4), count))
    shapes, colours = rng.sample(SHAPES, count), rng.sample(list(SHAPE_COLOURS), count)
    items = tuple((c, s, k, rng.choice(_SCALES)) for c, s, k in zip(cells, shapes, colours, strict=True))
    return rng.choice(SHAPE_IMAGE_SIZES), rng.choice(_BACKGROUNDS), items


def draw_shapes(layout: tuple) -> Image.Image:
    """The RGB picture of a `make_shapes_layout` layout."""
    (width, height), background, items = layout
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    cell_w, cell_h = width / 2, height / 2
    for cell, shape, colour, scale in items:
        side = min(cell_w, cell_h) * scale
        cx, cy = (cell % 2 + 0.5) * cell_w, (cell // 2 + 0.5) * cell_h
        box = (round(cx - side / 2), round(cy - side / 2), round(cx + side / 2) - 1, round(cy + side / 2) - 1)
        fill = SHAPE_COLOURS[colour]
        if shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), ((box[0] + box[2]) / 2, box[1]), (box[2], box[3])], fill=fill)
    return image


def write_synthetic_image_task(directory: str | Path, num_train: int, num_eval: int, seed: int) -> tuple[Path, Path]:
    """Write the shapes task as PNG files (`images/`) and `train.jsonl`/`eval.jsonl` in TRL's messages + images
    format, with image paths relative to the JSONL files; return the two paths.

    A row: `{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is
    the square?"}]}, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images":
    ["images/<hash>.png"]}`. Deterministic for a seed (the same bytes); no picture of the eval split occurs in
    train; existing files with the same parameters are reused.
    """
    directory = Path(directory) / f"shapes-{num_train}-{num_eval}-seed{seed}"
    return _write_disjoint(directory, num_train, num_eval, seed, lambda rng: _shapes_example(rng, directory),
                           lambda ex: ex["images"][0])  # fmt: skip


def _shapes_example(rng: random.Random, directory: Path) -> dict:
    layout = make_shapes_layout(rng)
    _, _, items = layout
    _, shape, colour, _ = rng.choice(items)
    question, answer = rng.choice(((f"What colour is the {shape}?", colour), (f"Which shape is {colour}?", shape)))
    name = f"images/{hashlib.sha256(repr(layout).encode()).hexdigest()[:16]}.png"  # the picture names its file
    path = directory / name
    if not path.is_file():  # a layout drawn again (a duplicate, rejected) has its file already
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        draw_shapes(layout).save(tmp, format="PNG")
        tmp.replace(path)
    user = [{"type": "image"}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": [name]}  # fmt: skip


def _write_disjoint(directory: Path, num_train: int, num_eval: int, seed: int, make, key) -> tuple[Path, Path]:
    train_path, eval_path = directory / "train.jsonl", directory / "eval.jsonl"
    if train_path.is_file() and eval_path.is_file():
        return train_path, eval_path
    rng = random.Random(seed)
    seen: set = set()
    rows: list[dict[str, str]] = []
    while len(rows) < num_train + num_eval:
        ex = make(rng)
        k = key(ex) if callable(key) else ex[key]
        if k not in seen:  # keeps the eval split truly held out
            seen.add(k)
            rows.append(ex)
    directory.mkdir(parents=True, exist_ok=True)
    for path, part in ((eval_path, rows[:num_eval]), (train_path, rows[num_eval:])):
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in part))
        tmp.replace(path)
    return train_path, eval_path
