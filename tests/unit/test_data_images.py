"""Images in TRL's format (data/images.py): placeholders widened as the processor widens them, image tokens out of
the loss, bad images refused naming the row, pixel tensors in the Batch split with their rows."""

from __future__ import annotations

import dataclasses
import io
import json

import datasets
import pytest
import torch
from PIL import Image

from posttrain.config import DataConfig
from posttrain.config.schema import ModelConfig
from posttrain.data import RowImages, collate_padded, collate_preference, tokenize_preference, tokenize_prompts
from posttrain.data import tokenize_sft, with_images
from posttrain.data.chat import render
from posttrain.errors import UserError
from posttrain.models.load import load_tokenizer
from posttrain.models.vision import load_processor

DATA = DataConfig(train="x", max_length=256, assistant_only_loss=True)


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    model_cfg = ModelConfig(name_or_path=str(tiny_vlm_dir))
    return load_processor(model_cfg, load_tokenizer(model_cfg))


def image_file(path, size=(56, 56), colour=(200, 30, 30)):
    Image.new("RGB", size, colour).save(path)
    return path


def user(images: int, text: str) -> dict:
    return {"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]}


def assistant(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def sft_rows(tmp_path, rows):
    """rows written to tmp_path/data.jsonl and read back as `datasets` reads a file (Arrow fills missing keys)."""
    file = tmp_path / "data.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return datasets.Dataset.from_json(str(file)), str(file)


def tokenize(tmp_path, rows, processor, tokenizer=None):
    dataset, source = sft_rows(tmp_path, rows)
    images = RowImages.of(dataset, processor, source, "data.train")
    return tokenize_sft(dataset, tokenizer or processor.tokenizer, DATA, "data.train", images=images)


def test_widened_ids_are_the_processors_and_image_tokens_are_out_of_the_loss(tmp_path, processor):
    image_file(tmp_path / "a.png", (56, 84))
    image_file(tmp_path / "b.png", (112, 56))
    messages = [user(2, "Which is red?"), assistant("the first")]
    examples, _ = tokenize(tmp_path, [{"messages": messages, "images": ["a.png", str(tmp_path / "b.png")]}], processor)
    ids, mask = examples[0]["input_ids"], examples[0]["completion_mask"]
    text = render(processor.tokenizer, messages)
    expected = processor(text=[text], images=[Image.open(tmp_path / "a.png"), Image.open(tmp_path / "b.png")])
    assert ids == expected["input_ids"][0]
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert ids.count(image_id) == (56 * 84 + 112 * 56) // 28 ** 2  # one token per 28 x 28 pixels
    assert not any(m for token, m in zip(ids, mask) if token == image_id)
    trained = processor.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "the first<|im_end|>"
    assert [ref.tokens for ref in examples[0]["images"]] == [6, 8]


def test_bytes_and_the_datasets_image_feature(tmp_path, processor):
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (0, 0, 255)).save(buffer, format="PNG")
    path = str(image_file(tmp_path / "blue.png", colour=(0, 0, 255)))
    messages = [user(1, "q"), assistant("blue")]
    undecoded = datasets.Dataset.from_list([{"messages": messages, "images": [{"bytes": buffer.getvalue(),
                                                                               "path": None}]}])
    raw = datasets.Dataset.from_list([{"messages": messages, "images": [buffer.getvalue()]}])
    feature = datasets.Dataset.from_list([{"messages": messages, "images": [path]}])
    feature = feature.cast_column("images", datasets.List(datasets.Image()))  # decodes to PIL images
    pixels = []
    for dataset in (undecoded, raw, feature):
        examples, _ = tokenize_sft(dataset, processor.tokenizer, DATA, "data.train",
                                   images=RowImages.of(dataset, processor, "hub/name", "data.train"))
        pixels += [ref.open().getpixel((5, 5)) for e in examples for ref in e["images"]]
    assert pixels == [(0, 0, 255)] * 3


@pytest.mark.parametrize("case, message", [
    ("missing", "data.train row 1: images 0: image file"),
    ("undecodable", "data.train row 1: image 0 ("),
    ("too many", "data.train row 1: has 2 image(s) in column 'images' but its messages hold 1"),
    ("too few", "data.train row 1: has 0 image(s) in column 'images' but its messages hold 1"),
])
def test_bad_images_are_refused_naming_the_row(tmp_path, processor, case, message):
    good = image_file(tmp_path / "good.png")
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    images = {"missing": ["nowhere.png"], "undecodable": ["broken.png"], "too many": ["good.png", "good.png"],
              "too few": []}[case]
    rows = [{"messages": [user(1, "q"), assistant("a")], "images": [good.name]},
            {"messages": [user(1, "q"), assistant("a")], "images": images}]
    with pytest.raises(UserError, match=None) as error:
        tokenize(tmp_path, rows, processor)
    assert message in str(error.value)


def test_an_image_column_needs_a_vision_model(tmp_path):
    dataset, source = sft_rows(tmp_path, [{"messages": [user(1, "q"), assistant("a")], "images": ["a.png"]}])
    with pytest.raises(UserError, match="'images' column, but model.name_or_path is a text model"):
        RowImages.of(dataset, None, source, "data.train")


def test_a_cut_through_an_image_drops_the_row(tmp_path, processor):
    image_file(tmp_path / "big.png", (224, 224))  # 16 image tokens (the tiny processor's most)
    rows = [{"messages": [user(1, "q"), assistant("a")], "images": ["big.png"]},
            {"messages": [user(0, "q"), assistant("a")], "images": []}]
    dataset, source = sft_rows(tmp_path, rows)
    examples, stats = tokenize_sft(dataset, processor.tokenizer, dataclasses.replace(DATA, max_length=14),
                                   "data.train", images=RowImages.of(dataset, processor, source, "data.train"))
    assert stats["dropped_image_cut"] == 1 and len(examples) == 1 and examples[0]["images"] == []


def test_preference_pairs_share_the_prompts_images(tmp_path, processor):
    image_file(tmp_path / "a.png")
    rows = [{"prompt": [user(1, "colour?")], "chosen": [assistant("red")], "rejected": [assistant("blue")],
             "images": ["a.png"]}]
    dataset, source = sft_rows(tmp_path, rows)
    examples, _ = tokenize_preference(dataset, processor.tokenizer, DATA, "data.train",
                                      images=RowImages.of(dataset, processor, source, "data.train"))
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert examples[0]["prompt_ids"].count(image_id) == 4
    batch = with_images(collate_preference(examples, 0), [examples[0]["images"]] * 2, processor)
    assert batch.vision.images_B.tolist() == [1, 1]
    assert torch.equal(batch.vision.pixel_values[:16], batch.vision.pixel_values[16:])


def test_prompts_carry_their_images(tmp_path, processor):
    image_file(tmp_path / "a.png")
    dataset, source = sft_rows(tmp_path, [{"prompt": [user(1, "colour?")], "answer": "red", "images": ["a.png"]}])
    examples, _ = tokenize_prompts(dataset, processor.tokenizer, DATA, "data.train",
                                   images=RowImages.of(dataset, processor, source, "data.train"))
    assert len(examples[0]["images"]) == 1 and examples[0]["columns"]["answer"] == "red"


def test_vision_inputs_split_with_their_rows(tmp_path, processor):
    image_file(tmp_path / "a.png", (56, 56), (255, 0, 0))
    image_file(tmp_path / "b.png", (84, 56), (0, 255, 0))
    rows = [{"messages": [user(2, "q"), assistant("a")], "images": ["a.png", "b.png"]},
            {"messages": [user(0, "q"), assistant("b")], "images": []},
            {"messages": [user(1, "q"), assistant("c")], "images": ["b.png"]}]
    examples, _ = tokenize(tmp_path, rows, processor)
    batch = with_images(collate_padded(examples, 0), [e["images"] for e in examples], processor)
    assert batch.vision.patches_I.tolist() == [16, 24, 24] and batch.vision.pixel_values.shape[0] == 64
    first, middle, last = batch.rows(0, 1), batch.rows(1, 2), batch.rows(2, 3)
    assert middle.vision is None
    assert torch.equal(first.vision.pixel_values, batch.vision.pixel_values[:40])
    assert torch.equal(last.vision.pixel_values, batch.vision.pixel_values[40:])
    assert last.vision.image_grid_thw.tolist() == [[1, 4, 6]]  # (t, height, width) in patches
    inputs = last.model_inputs()
    assert inputs["mm_token_type_ids"].sum() == 6 and set(inputs) >= {"pixel_values", "image_grid_thw"}


def test_string_contents_get_their_images_before_the_first_user_text_as_trl_places_them(tmp_path, processor):
    image_file(tmp_path / "a.png")
    explicit = {"messages": [user(1, "colour?"), assistant("red")], "images": ["a.png"]}
    plain = {"messages": [{"role": "user", "content": "colour?"}, {"role": "assistant", "content": "red"}],
             "images": ["a.png"]}
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    image_file(tmp_path / "one" / "a.png")
    image_file(tmp_path / "two" / "a.png")
    first, _ = tokenize(tmp_path / "one", [explicit], processor)
    second, _ = tokenize(tmp_path / "two", [plain], processor)
    assert first[0]["input_ids"] == second[0]["input_ids"]
    assert first[0]["completion_mask"] == second[0]["completion_mask"]


def test_a_single_image_column(tmp_path, processor):
    image_file(tmp_path / "a.png")
    examples, _ = tokenize(tmp_path, [{"messages": [user(1, "q"), assistant("a")], "image": "a.png"},
                                      {"messages": [user(0, "q"), assistant("b")], "image": None}], processor)
    assert [len(e["images"]) for e in examples] == [1, 0]
    dataset, source = sft_rows(tmp_path, [{"messages": [user(1, "q"), assistant("a")], "image": "a.png",
                                           "images": ["a.png"]}])
    with pytest.raises(UserError, match="has both an 'images' and an 'image' column"):
        RowImages.of(dataset, processor, source, "data.train")


def test_samples_name_their_images_by_file(tmp_path):
    """samples.jsonl names a file image by its absolute path, and writes an image given as bytes once into the run's
    sample_images/ (by its content's hash), naming that file."""
    from posttrain.data.images import ImageRef, image_names

    image_file(tmp_path / "a.png")
    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), (0, 200, 0)).save(buffer, format="PNG")
    refs = [ImageRef(path=str(tmp_path / "a.png")), ImageRef(data=buffer.getvalue())]
    names = image_names(refs, tmp_path / "run" / "sample_images")
    assert names[0] == str((tmp_path / "a.png").resolve())
    written = tmp_path / "run" / "sample_images"
    assert [str(p.resolve()) for p in written.iterdir()] == [names[1]]
    assert Image.open(names[1]).convert("RGB").tobytes() == refs[1].open().tobytes()
    assert image_names(refs, written) == names  # the same bytes, the same file
