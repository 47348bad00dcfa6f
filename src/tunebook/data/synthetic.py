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


# The generated image task: a picture of ONE shape (square, circle or triangle) in one of six colours, at a random
# position and size on a plain background; the question "What colour is the square?" names the shape, never its
# colour, so the text alone does no better than guessing (1 in 6) and the answer must come from the picture's pixels.
# (A "What shape is it?" question was tried and left out: the tiny default model stayed near 0.5 on it after 750
# steps, while it answers the colour of a shape anywhere on the picture after ~100.) Sizes are multiples of 28 pixels
# (a Qwen2-VL image token's side) and differ, so a model whose image token count depends on the size sees 4, 6 and 12
# tokens.
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


def make_shapes_layout(rng: random.Random) -> tuple:
    """A picture as data: (size, background, shape, colour, box), box = (left, top, side) in pixels: one shape whose
    side is 45-85% of the picture's shorter side, anywhere inside it."""
    width, height = rng.choice(SHAPE_IMAGE_SIZES)
    side = round(min(width, height) * rng.uniform(0.45, 0.85))
    box = (rng.randint(0, width - side), rng.randint(0, height - side), side)
    return (width, height), rng.choice(_BACKGROUNDS), rng.choice(SHAPES), rng.choice(list(SHAPE_COLOURS)), box


def draw_shapes(layout: tuple) -> Image.Image:
    """The RGB picture of a `make_shapes_layout` layout."""
    (width, height), background, shape, colour, (left, top, side) = layout
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    box = (left, top, left + side - 1, top + side - 1)
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
    directory = Path(directory) / f"shapes-v2-{num_train}-{num_eval}-seed{seed}"  # v2: one shape a picture
    return _write_disjoint(directory, num_train, num_eval, seed, lambda rng: _shapes_example(rng, directory),
                           lambda ex: ex["images"][0])  # fmt: skip


def _shapes_example(rng: random.Random, directory: Path) -> dict:
    layout = make_shapes_layout(rng)
    _, _, shape, answer, _ = layout
    question = f"What colour is the {shape}?"
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


def write_synthetic_image_preferences(directory: str | Path, num_train: int, num_eval: int,
                                      seed: int) -> tuple[Path, Path]:  # fmt: skip
    """The shapes task's own pictures as preference pairs (DPO with images): `pairs-train.jsonl`/`pairs-eval.jsonl`
    beside the task's files (`write_synthetic_image_task`, same arguments, so the same pictures), in TRL's vision
    DPO format; return the two paths.

    A row: `{"prompt": [the user turn, image part first], "chosen": [{"role": "assistant", "content": [...
    "red"]}], "rejected": [... a wrong colour], "images": ["images/<hash>.png"]}`. The wrong colour is drawn from
    the picture's name, so pairs of a picture are the same whatever else changes.
    """
    paths = write_synthetic_image_task(directory, num_train, num_eval, seed)
    out = []
    for path in paths:
        target = path.with_name(f"pairs-{path.name}")
        out.append(target)
        if target.is_file():
            continue
        rows = []
        for line in path.read_text().splitlines():
            example = json.loads(line)
            user, answer = example["messages"]
            colour = answer["content"][0]["text"]
            rng = random.Random(example["images"][0])
            wrong = rng.choice([c for c in SHAPE_COLOURS if c != colour])
            rows.append({"prompt": [user], "chosen": [answer],
                         "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}],
                         "images": example["images"]})  # fmt: skip
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(target)
    return out[0], out[1]
