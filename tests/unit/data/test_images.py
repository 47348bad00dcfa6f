"""A vision-language model's rows: every shape users bring reads into one normal form, image references resolve,
sizes come from headers, and a bad image is one line naming the data file, row and image (or a counted skip)."""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tunebook.data.formats import to_conversations
from tunebook.data.image_files import image_reference, image_size, open_image, open_images
from tunebook.data.images import (
    IMAGE_FEATURES,
    check_images,
    parse_image_row,
    read_image_source,
    to_image_conversations,
)
from tunebook.data.sources import DataSource
from tunebook.data.synthetic import (
    SHAPE_COLOURS,
    SHAPE_IMAGE_SIZES,
    SHAPES,
    write_synthetic_image_task,
)
from tunebook.errors import DataError

QUESTION = "What colour is it?"
EXPECTED_MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
    {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
]


def png(path: Path, size=(4, 3), colour="red", mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


def png_bytes(size=(4, 3), colour="red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    png(tmp_path / "img" / "red.png", (4, 3), "red")
    png(tmp_path / "img" / "blue.png", (5, 6), "blue")
    return tmp_path


def trl(content, images=None, answer="red") -> dict:
    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}
    return row if images is None else {**row, "images": images}


# --------------------------------------------------------------------------------------------------------------
# Shapes -> one normal form


def test_every_shape_reads_into_the_same_normal_form(folder):
    red = str(folder / "img" / "red.png")
    image_first = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    rows = {
        "trl": trl(image_first, ["img/red.png"], answer=[{"type": "text", "text": "red"}]),
        "trl, string content (TRL puts the images first)": trl(QUESTION, ["img/red.png"]),
        "trl, absolute path": trl(image_first, [red]),
        "trl, one image in 'image'": {**trl(image_first), "image": "img/red.png"},
        "inline image": trl([{"type": "image", "image": "img/red.png"}, {"type": "text", "text": QUESTION}]),
        "inline path": trl([{"type": "image", "path": red}, {"type": "text", "text": QUESTION}]),
        "inline url key with a path": trl([{"type": "image", "url": "img/red.png"}, QUESTION]),
        "llava, image": {
            "conversations": [{"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": "red"}],
            "image": "img/red.png",
        },
        "llava, images": {
            "conversations": [{"from": "human", "value": f"<image> {QUESTION}"}, {"from": "gpt", "value": "red"}],
            "images": ["img/red.png"],
        },
        "prompt/completion, messages": {
            "prompt": [{"role": "user", "content": image_first}],
            "completion": [{"role": "assistant", "content": "red"}],
            "images": ["img/red.png"],
        },
        "prompt/completion, text": {"prompt": QUESTION, "completion": "red", "images": ["img/red.png"]},
    }
    for shape, row in rows.items():
        parsed = parse_image_row(json.loads(json.dumps(row)), where="data.jsonl, row 1", base_dir=folder)
        assert parsed.pop("completion_start", 1) == 1, shape  # the prompt is one message
        assert parsed == {"messages": EXPECTED_MESSAGES, "images": [{"path": red, "bytes": None}]}, shape


def test_an_images_position_among_the_text_is_kept(folder):
    llava = {
        "conversations": [{"from": "human", "value": "Compare <image> with\n<image>."}, {"from": "gpt", "value": "x"}],
        "images": ["img/red.png", "img/blue.png"],
    }
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image"},
        {"type": "text", "text": "with"},
        {"type": "image"},
        {"type": "text", "text": "."},
    ]
    inline = trl(
        ["Compare", {"type": "image", "image": "img/red.png"}, "with", {"type": "image", "image": "img/blue.png"}, "."]
    )
    for row in (llava, trl(content, ["img/red.png", "img/blue.png"]), inline):
        parsed = parse_image_row(row, where="r", base_dir=folder)
        assert parsed["messages"][0]["content"] == content
        assert [Path(r["path"]).name for r in parsed["images"]] == ["red.png", "blue.png"]
    text_first = parse_image_row(trl([QUESTION, {"type": "image"}], ["img/red.png"]), where="r", base_dir=folder)
    assert text_first["messages"][0]["content"] == [{"type": "text", "text": QUESTION}, {"type": "image"}]


def test_text_only_rows_pass_and_a_text_model_still_refuses_images(folder):
    parsed = parse_image_row(trl("Hi", None, "Hello"), where="r")
    assert parsed["images"] == [] and parsed["messages"][0]["content"] == [{"type": "text", "text": "Hi"}]
    batch = {"messages": [trl([{"type": "image"}, QUESTION])["messages"]]}
    with pytest.raises(DataError, match="only text parts can be trained on by a text model"):
        to_conversations(batch, [0], data_format="chat", where="data.jsonl")
    with pytest.raises(DataError, match=r"^a.jsonl: data format 'alpaca' has no place for images"):
        parse_image_row({"instruction": "Hi", "output": "Hello", "image": "x.png"}, where="a.jsonl")
    with pytest.raises(DataError, match=r"^a.jsonl: both an 'images' and an 'image' column"):
        parse_image_row({**IMAGE_FIRST, "image": "x.png"}, where="a.jsonl")


IMAGE_FIRST = trl([{"type": "image"}, QUESTION], ["img/red.png"])
LLAVA_OK = {
    "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}],
    "image": "img/red.png",
}
LLAVA_TWO = {
    **LLAVA_OK,
    "conversations": [{"from": "human", "value": "<image><image>?"}, {"from": "gpt", "value": "x"}],
}


@pytest.mark.parametrize(
    "good, bad, counts",
    [
        (IMAGE_FIRST, trl([{"type": "image"}, {"type": "image"}, QUESTION], ["img/red.png"]),
         "2 image placeholders but 1 images"),
        (IMAGE_FIRST, trl([{"type": "image"}, QUESTION], ["img/red.png", "img/blue.png"]),
         "1 image placeholders but 2 images"),
        (IMAGE_FIRST, trl([QUESTION], ["img/red.png"]), "0 image placeholders but 1 images"),  # list: no place
        (trl(QUESTION), trl([{"type": "image"}, QUESTION]),
         r"1 image placeholders but 0 images \(no 'images' column\)"),
        (LLAVA_OK, LLAVA_TWO, "2 '<image>' tokens but 1 images in column 'image'"),
        ({"prompt": QUESTION, "completion": "x", "images": ["img/red.png"]},
         {"prompt": [{"role": "user", "content": [QUESTION]}], "completion": "x", "images": ["img/red.png"]},
         "0 image placeholders but 1 images in column 'images'"),
    ],
)  # fmt: skip
def test_a_count_mismatch_is_one_line_naming_file_row_and_both_counts(folder, good, bad, counts):
    data = write_jsonl(folder / "train.jsonl", [good, bad])
    with pytest.raises(DataError, match=rf"^{data}, row 2: {counts}") as error:
        read_image_source(DataSource(str(data)), folder / "cache", seed=0)
    assert "\n" not in str(error.value)


def test_a_tools_column_is_kept_as_formats_keeps_it(folder):
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": None}}]
    parsed = parse_image_row({**IMAGE_FIRST, "tools": tools}, where="r", base_dir=folder)
    assert parsed["tools"] == [{"type": "function", "function": {"name": "zoom"}}]


def test_images_inline_and_in_the_column_at_once_are_refused(folder):
    row = trl([{"type": "image", "image": "img/red.png"}, {"type": "image"}], ["img/blue.png"])
    with pytest.raises(DataError, match="1 images inline in the messages and 1 in column 'images'"):
        parse_image_row(row, where="r", base_dir=folder)


# --------------------------------------------------------------------------------------------------------------
# References


def test_references_of_every_kind(folder):
    red = folder / "img" / "red.png"
    data = png_bytes()
    assert image_reference("img/red.png", folder) == {"path": str(red), "bytes": None}
    assert image_reference(str(red), "/elsewhere") == {"path": str(red), "bytes": None}
    assert image_reference({"bytes": None, "path": "img/red.png"}, folder) == {"path": str(red), "bytes": None}
    assert image_reference({"bytes": data, "path": "cat.png"}) == {"path": "cat.png", "bytes": data}  # a Hub row
    assert image_reference({"bytes": data, "path": None}) == {"path": None, "bytes": data}
    url = "https://example.com/a.png"
    assert image_reference(url, folder) == {"path": url, "bytes": None}
    inline = image_reference(f"data:image/png;base64,{base64.b64encode(data).decode()}")
    assert inline == {"path": None, "bytes": data}
    # A PIL image (a Hub data set decoded in memory) is stored as PNG bytes, pixels unchanged, CMYK as RGB.
    for image in (Image.new("RGB", (3, 2), (1, 2, 3)), Image.new("RGBA", (3, 2), (1, 2, 3, 4))):
        reference = image_reference(image)
        assert reference["path"] is None and Image.open(io.BytesIO(reference["bytes"])).tobytes() == image.tobytes()
    assert Image.open(io.BytesIO(image_reference(Image.new("CMYK", (2, 2)))["bytes"])).mode == "RGB"
    for bad, message in ((None, "missing"), ("  ", "empty"), ({"bytes": None, "path": None}, "neither"), (3, "int")):
        with pytest.raises(DataError, match=rf"^data.jsonl, row 4, image 1: .*{message}"):
            image_reference(bad, folder, "data.jsonl, row 4, image 1")


def test_sizes_from_the_header_and_opening_as_rgb(folder):
    red = image_reference("img/red.png", folder)
    assert image_size(red) == (4, 3)
    opened = open_image(red)
    assert opened.mode == "RGB" and opened.size == (4, 3) and opened.getpixel((0, 0)) == (255, 0, 0)
    # Transparency on white, as transformers' convert_to_rgb; palette and grey images as RGB.
    clear = png(folder / "clear.png", (2, 2), (0, 0, 0, 0), mode="RGBA")
    assert open_image(image_reference(str(clear))).getpixel((0, 0)) == (255, 255, 255)
    grey = png(folder / "grey.png", (2, 2), 128, mode="L")
    assert open_image(image_reference(str(grey))).getpixel((0, 0)) == (128, 128, 128)
    assert [i.size for i in open_images([red, image_reference("img/blue.png", folder)], "r")] == [(4, 3), (5, 6)]


def test_exif_orientation_turns_the_size_as_opening_turns_the_image(tmp_path):
    path = tmp_path / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored on its side: shown rotated by 90 degrees
    Image.new("RGB", (40, 20), "red").save(path, exif=exif.tobytes())
    reference = image_reference(str(path))
    assert image_size(reference) == (20, 40) == open_image(reference).size


def bad_images(folder: Path) -> dict[str, tuple[str, str]]:
    """Files that fail, each with the message its row's line must carry."""
    (folder / "img" / "garbage.png").write_bytes(b"this is not an image at all")
    png(folder / "img" / "huge.png", (200, 100))
    return {
        "missing": ("img/missing.png", r"img/missing.png\): not found"),
        "garbage": ("img/garbage.png", r"img/garbage.png\): not an image file Pillow can read"),
        "oversized": ("img/huge.png", r"img/huge.png\): 200x100 is 20,000 pixels, more than max_image_pixels "),
    }


@pytest.mark.parametrize("kind", ["missing", "garbage", "oversized"])
def test_a_bad_image_is_one_line_naming_the_file_row_and_image(folder, kind):
    name, message = bad_images(folder)[kind]
    data = write_jsonl(folder / "data.jsonl", [trl([{"type": "image"}, QUESTION], ["img/red.png"])] * 2
                       + [trl([{"type": "image"}, "?", {"type": "image"}], ["img/red.png", name])])  # fmt: skip
    rows = read_image_source(DataSource(str(data)), folder / "cache", seed=0)
    with pytest.raises(DataError, match=rf"^{data}, row 3, image 2 \({folder}/{message}") as error:
        check_images(rows, max_pixels=10_000)
    assert "\n" not in str(error.value)


def test_skip_drops_and_counts_the_rows_with_a_bad_image_before_any_batch(folder):
    bad = bad_images(folder)
    rows = [trl([{"type": "image"}, QUESTION], ["img/red.png"])]
    rows += [trl([{"type": "image"}, QUESTION], [bad[kind][0]]) for kind in ("missing", "garbage", "oversized")]
    rows += [trl(QUESTION, ["img/blue.png", "img/red.png"]), trl("text only", [])]
    data = write_jsonl(folder / "data.jsonl", rows)
    checked = check_images(read_image_source(DataSource(str(data)), folder / "cache", seed=0),
                           on_bad_image="skip", max_pixels=10_000)  # fmt: skip
    assert checked.skipped == 3 and len(checked.dataset) == 3
    assert [line.split(" (")[0] for line in checked.first_skipped] == [f"{data}, row {r}, image 1" for r in (2, 3, 4)]
    assert checked.dataset["image_sizes"] == [[[4, 3]], [[5, 6], [4, 3]], []]
    wheres = [json.loads(c)["where"] for c in checked.dataset["conversation"]]
    assert wheres == [f"{data}, row 1", f"{data}, row 5", f"{data}, row 6"]


def test_sizes_are_read_again_every_time_never_from_a_cache(folder):
    data = write_jsonl(folder / "data.jsonl", [trl([{"type": "image"}, QUESTION], ["img/red.png"])] * 2)
    rows = read_image_source(DataSource(str(data)), folder / "cache", seed=0)
    assert check_images(rows).dataset["image_sizes"] == [[[4, 3]]] * 2
    png(folder / "img" / "red.png", (8, 2))  # replaced since: another size
    assert check_images(rows).dataset["image_sizes"] == [[[8, 2]]] * 2
    (folder / "img" / "red.png").unlink()
    with pytest.raises(
        DataError, match=r"every row has a bad image \(2 rows\), the first: .*row 1, image 1 .*not found"
    ):
        check_images(rows, on_bad_image="skip")


def test_a_file_damaged_past_its_header_passes_the_check_and_fails_on_opening(folder):
    png(folder / "img" / "big.png", (64, 64))
    cut = folder / "img" / "cut.png"
    cut.write_bytes((folder / "img" / "big.png").read_bytes()[:60])  # the header, then nothing
    reference = image_reference(str(cut))
    assert image_size(reference) == (64, 64)
    with pytest.raises(DataError, match=rf"^data.jsonl, row 9, image 1 \({cut}\): could not be read"):
        open_image(reference, "data.jsonl, row 9, image 1")


def test_a_url_fails_at_once_offline_and_in_one_line_when_unreachable(monkeypatch):
    reference = image_reference("https://example.com/cat.png")
    start = time.monotonic()
    with pytest.raises(DataError, match=r"^row 2, image 1 \(https://example.com/cat.png\): a URL, and HF_HUB_OFF"):
        image_size(reference, "row 2, image 1")  # the tests run with HF_HUB_OFFLINE=1
    assert time.monotonic() - start < 1
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    seen = {}

    def unreachable(url, timeout):
        seen["timeout"] = timeout
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    with pytest.raises(DataError, match=r"could not be downloaded: .*name resolution") as error:
        open_image(reference, "row 2, image 1")
    assert "\n" not in str(error.value) and seen["timeout"] <= 30


# --------------------------------------------------------------------------------------------------------------
# Data sets as datasets reads them


@pytest.mark.parametrize("ending", ["jsonl", "parquet"])
def test_rows_as_datasets_reads_them_read_as_written(folder, ending):
    """datasets' JSON reader keeps parts of different keys as JSON; Parquet (how Hub data arrives) gives every part
    every key, `image`/`text` None where a part has none, and a row without images a null `images`."""
    rows = [
        trl([{"type": "image"}, {"type": "text", "text": QUESTION}], ["img/red.png"], EXPECTED_MESSAGES[1]["content"]),
        trl([{"type": "text", "text": QUESTION}, {"type": "image", "image": "img/blue.png"}], None,
            [{"type": "text", "text": "blue"}]),
        trl([{"type": "text", "text": "No picture"}], None, [{"type": "text", "text": "ok"}]),
    ]  # fmt: skip
    data = write_jsonl(folder / "mixed.jsonl", rows)
    if ending == "parquet":
        data = folder / "mixed.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data)
    raw = datasets.load_dataset("json" if ending == "jsonl" else "parquet", data_files=str(data), split="train",
                                cache_dir=str(folder / "cache"))  # fmt: skip
    if ending == "parquet":
        assert raw[0]["messages"][0]["content"][0] == {"type": "image", "text": None, "image": None}
    assert raw[1]["images"] is None
    converted = raw.map(to_image_conversations, batched=True, with_indices=True, remove_columns=raw.column_names,
                        features=IMAGE_FEATURES, fn_kwargs={"data_format": "chat", "where": str(data),
                                                            "base_dir": folder})  # fmt: skip
    conversations = [json.loads(c) for c in converted["conversation"]]
    assert conversations[0]["messages"] == EXPECTED_MESSAGES
    assert conversations[1]["messages"][0]["content"] == [{"type": "text", "text": QUESTION}, {"type": "image"}]
    assert [[Path(r["path"]).name for r in refs] for refs in converted["images"]] == [["red.png"], ["blue.png"], []]
    assert conversations[2]["where"] == f"{data}, row 3"
    # The same through a source, as a recipe reads it.
    again = read_image_source(DataSource(str(data)), folder / "cache", seed=0)
    assert again["conversation"] == converted["conversation"] and again["images"] == converted["images"]


def test_an_image_feature_column_is_read_without_decoding(folder, monkeypatch):
    """A Hub-style data set: `images` a list of `datasets.Image()`, some stored as bytes (PIL images given to
    datasets), some as paths; saved with save_to_disk and read back as a source."""
    features = datasets.Features(
        {"messages": datasets.Json(), "images": datasets.List(datasets.Image())}
    )  # a Json column: its parts keep their own keys
    messages = trl([{"type": "image"}, QUESTION], None, "red")["messages"]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}, messages[1]]
    dataset = datasets.Dataset.from_dict(
        {"messages": [messages, two], "images": [[Image.new("RGB", (7, 5), "red")],
                                                 [str(folder / "img" / "blue.png"), {"bytes": png_bytes((2, 9))}]]},
        features=features,
    )  # fmt: skip
    assert isinstance(dataset[0]["images"][0], Image.Image)  # what a row shows when decoded
    dataset.save_to_disk(str(folder / "saved"))
    decoded = []
    original = datasets.Image.decode_example
    monkeypatch.setattr(
        datasets.Image, "decode_example", lambda self, *a, **k: decoded.append(1) or original(self, *a, **k)
    )
    rows = read_image_source(DataSource(str(folder / "saved")), folder / "cache", seed=0)
    assert not decoded  # the images were copied as bytes or paths, never decoded to pixels
    assert json.loads(rows[0]["conversation"])["messages"] == EXPECTED_MESSAGES
    assert rows.features["images"] == datasets.List(datasets.Image(decode=False))
    checked = check_images(rows)
    assert checked.dataset["image_sizes"] == [[[7, 5]], [[5, 6], [2, 9]]] and checked.skipped == 0
    assert [i.size for i in open_images(checked.dataset[1]["images"], "r")] == [(5, 6), (2, 9)]


# --------------------------------------------------------------------------------------------------------------
# The generated task


def test_the_shapes_task_is_deterministic_disjoint_varied_and_reads_as_trl_rows(tmp_path):
    train, evaluation = write_synthetic_image_task(tmp_path / "a", 60, 20, seed=3)
    again = write_synthetic_image_task(tmp_path / "b", 60, 20, seed=3)
    files = sorted(p.relative_to(train.parent) for p in train.parent.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again[0].parent) for p in again[0].parent.rglob("*") if p.is_file())
    assert all((train.parent / f).read_bytes() == (again[0].parent / f).read_bytes() for f in files)
    assert len(files) == 60 + 20 + 2  # one picture per row, then the two JSONL files
    rows = {path: [json.loads(line) for line in path.read_text().splitlines()] for path in (train, evaluation)}
    assert len(rows[train]) == 60 and len(rows[evaluation]) == 20
    assert not {r["images"][0] for r in rows[train]} & {r["images"][0] for r in rows[evaluation]}
    answers: dict[str, set] = {}
    for r in rows[train]:
        answers.setdefault(r["messages"][0]["content"][1]["text"], set()).add(r["messages"][1]["content"][0]["text"])
    assert max(len(a) for a in answers.values()) > 1  # the same question, different answers: look at the picture
    # One shape a picture, named by the question, which says nothing of the answer: its colour (1 in 6).
    assert set(answers) == {f"What colour is the {shape}?" for shape in SHAPES}
    assert all(a <= set(SHAPE_COLOURS) and len(a) >= 4 for a in answers.values()), answers
    for r in rows[train][:10]:  # the picture holds the answer: its colour is the only non-background colour
        colours = {c for _, c in open_image({"path": str(train.parent / r["images"][0]), "bytes": None}).getcolors()}
        answer = r["messages"][1]["content"][0]["text"]
        assert len(colours) == 2 and SHAPE_COLOURS[answer] in colours, colours
    checked = check_images(read_image_source(DataSource(str(train)), tmp_path / "cache", seed=0))
    sizes = {tuple(s[0]) for s in checked.dataset["image_sizes"]}
    assert sizes <= set(SHAPE_IMAGE_SIZES) and len(sizes) >= 3
    # Reused: the same parameters write nothing again.
    stamp = train.stat().st_mtime_ns
    assert write_synthetic_image_task(tmp_path / "a", 60, 20, seed=3) == (train, evaluation)
    assert train.stat().st_mtime_ns == stamp
    other = write_synthetic_image_task(tmp_path / "a", 60, 20, seed=4)[0]
    assert other.read_text() != train.read_text()
