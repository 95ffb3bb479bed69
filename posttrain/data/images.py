"""Images beside conversations, in TRL's format: an `images` column (a list per row) or an `image` column (one).

    images = RowImages.of(dataset, processor, "data/train.jsonl", "data.train")   # None without an image column
    refs = images.refs(row, "data.train row 3")            # checked: each image exists and decodes; counts match
    input_ids, mask = images.widen(input_ids, mask, refs)  # each placeholder token as many times as the image's tokens
    batch = with_images(batch, [refs of each row], processor)  # the processor's pixel tensors, in the Batch

An image is a path (relative to the data file's folder, or absolute), raw bytes, or the `datasets` Image feature
({"bytes", "path"} from parquet / arrow undecoded, or the PIL image it decodes to: kept by its file, else re-encoded
as PNG bytes). A conversation places its images with content parts
`{"type": "image"}`, in order; the chat template renders each as the model's placeholder (Qwen2-VL's
<|vision_start|><|image_pad|><|vision_end|>), and the processor widens the placeholder token to the image's token
count. Tokenisation opens every image once, to refuse a missing or undecodable one naming its row before any model
loads, and to count its tokens; the pixels are read again only when the row's micro-batch is built (lazily), so a
dataset's images are never all in memory.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from posttrain.batch import Batch, VisionInputs
from posttrain.errors import UserError

COLUMNS = ("images", "image")
"""TRL's image columns: a list of images per row, or one."""
SAMPLE_IMAGES = "sample_images"
"""The run directory's folder of sampled prompts' images given as bytes (samples.jsonl names them by path)."""
PROCESSOR_TENSORS = ("pixel_values", "image_grid_thw")
"""The image processor outputs a VisionInputs carries (Qwen-VL's; others are refused when they appear)."""


@dataclass(frozen=True)
class ImageRef:
    """Where one image's bytes are: a file (absolute path) or the bytes themselves."""

    path: Optional[str] = None
    data: Optional[bytes] = None
    tokens: int = 0
    """How many image tokens the processor gives it (it widens the image's placeholder token to this many)."""

    def open(self):
        """The image, decoded, in RGB."""
        from PIL import Image

        with Image.open(io.BytesIO(self.data) if self.data is not None else self.path) as image:
            return image.convert("RGB")

    def data_url(self) -> str:
        """The image as a PNG data URL (what an HTTP server takes in a request)."""
        import base64

        buffer = io.BytesIO()
        self.open().save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")

    def __str__(self) -> str:
        return repr(self.path) if self.path is not None else f"<{len(self.data)} bytes>"


def image_parts(messages: list[dict]) -> int:
    """How many `{"type": "image"}` parts the messages' contents hold."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


class RowImages:
    """One dataset's image column, read for the tokenisers (see the module docstring)."""

    def __init__(self, processor, column: str, base_dir: Optional[Path]):
        self.processor, self.column, self.base_dir = processor, column, base_dir
        self.token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)

    @classmethod
    def of(cls, dataset, processor, source: str, what: str) -> Optional["RowImages"]:
        """The dataset's image column, or None when it has none. A processor is needed when it has one, and a text
        model (processor None) with an image column is refused."""
        columns = [c for c in COLUMNS if c in dataset.column_names]
        if not columns:
            return None
        if len(columns) > 1:
            raise UserError(f"{what}: has both an 'images' and an 'image' column; keep one (images: a list per row)")
        if processor is None:
            raise UserError(f"{what}: has an {columns[0]!r} column, but model.name_or_path is a text model; train a "
                            "vision-language model (docs/vision.md) or drop the column")
        path = Path(source).expanduser()
        base = path if path.is_dir() else path.parent if path.is_file() else None
        return cls(processor, columns[0], base)

    def placed(self, row: dict, columns: tuple[str, ...]) -> dict:
        """`row` with its images placed as TRL places them when no message holds an image part: one
        {"type": "image"} part per image before the text of the first user message of each of `columns`."""
        value = row.get(self.column)
        count = 0 if value is None else len(value) if self.column == "images" else 1
        if not count or any(image_parts(row.get(c) or []) for c in columns):
            return row
        placed = dict(row)
        for column in columns:
            messages = [dict(m) for m in row.get(column) or []]
            first = next((m for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)), None)
            if first is not None:
                first["content"] = [{"type": "image"}] * count + [{"type": "text", "text": first["content"]}]
                placed[column] = messages
        return placed

    def refs(self, row: dict, messages: list[dict], where: str) -> list[ImageRef]:
        """The row's images, each opened once (it exists and decodes); as many as the messages' image parts."""
        value = row.get(self.column)
        values = [] if value is None else value if self.column == "images" else [value]
        if not isinstance(values, list):
            raise UserError(f"{where}: column 'images' must be a list of images, got {type(values).__name__}")
        refs = [self._ref(v, f"{where}: {self.column} {k}") for k, v in enumerate(values)]
        parts = image_parts(messages)
        if parts != len(refs):
            raise UserError(f"{where}: has {len(refs)} image(s) in column {self.column!r} but its messages hold "
                            f"{parts} {{'type': 'image'}} part(s); give one image per image part, in order")
        return [self._counted(ref, f"{where}: image {k} ({ref})") for k, ref in enumerate(refs)]

    def _counted(self, ref: ImageRef, where: str) -> ImageRef:
        """`ref` with its token count, from the processor's own widening of one placeholder."""
        try:
            image = ref.open()
        except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            raise UserError(f"{where} cannot be read as an image: {e}") from None
        encoded = self.processor(text=[self.processor.image_token], images=[image])
        return dataclasses.replace(ref, tokens=sum(1 for t in encoded["input_ids"][0] if t == self.token_id))

    def _ref(self, value, where: str) -> ImageRef:
        if hasattr(value, "getpixel"):  # a PIL image, as the datasets Image feature decodes one: kept by its file
            if getattr(value, "filename", ""):
                return ImageRef(path=value.filename)
            buffer = io.BytesIO()
            value.save(buffer, format="PNG")
            return ImageRef(data=buffer.getvalue())
        if isinstance(value, dict):  # the datasets Image feature, undecoded
            if value.get("bytes"):
                return ImageRef(data=bytes(value["bytes"]))
            value = value.get("path")
        if isinstance(value, (bytes, bytearray)):
            return ImageRef(data=bytes(value))
        if not isinstance(value, str) or not value:
            raise UserError(f"{where} must be a path, bytes or {{'bytes', 'path'}}, got {type(value).__name__}")
        path = Path(value).expanduser()
        if not path.is_absolute():
            if self.base_dir is None:
                raise UserError(f"{where}: relative path {value!r} in a hub dataset; give absolute paths or bytes")
            path = self.base_dir / path
        if not path.is_file():
            raise UserError(f"{where}: image file {path} does not exist (relative paths are read from "
                            f"{self.base_dir})")
        return ImageRef(path=str(path))

    def widen(self, input_ids: list[int], mask: list[int], refs: list[ImageRef]) -> tuple[list[int], list[int]]:
        """input_ids with the k-th placeholder token repeated as many times as image k's tokens (as the processor
        does to the text), out of the loss mask."""
        counts = iter([ref.tokens for ref in refs])
        ids_out, mask_out = [], []
        for token, m in zip(input_ids, mask):
            n = next(counts) if token == self.token_id else 1
            ids_out += [token] * n
            mask_out += [0 if token == self.token_id else m] * n
        return ids_out, mask_out


def vision_inputs(images_B: list[list[ImageRef]], processor) -> Optional[VisionInputs]:
    """The pixel tensors of each row's images (opened now), from the model's image processor; None without images."""
    flat = [ref for refs in images_B for ref in refs]
    if not flat:
        return None
    out = processor.image_processor(images=[ref.open() for ref in flat], return_tensors="pt")
    unknown = sorted(set(out.keys()) - set(PROCESSOR_TENSORS))
    if unknown:
        raise UserError(f"{type(processor.image_processor).__name__} returns {', '.join(unknown)}, which posttrain "
                        "does not pass to the model yet (it passes pixel_values and image_grid_thw)")
    grid = out.get("image_grid_thw")
    patches_I = grid.prod(-1) if grid is not None else torch.ones(len(flat), dtype=torch.long)
    return VisionInputs(pixel_values=out["pixel_values"], patches_I=patches_I,
                        images_B=torch.tensor([len(refs) for refs in images_B], dtype=torch.long), image_grid_thw=grid,
                        image_token_id=processor.tokenizer.convert_tokens_to_ids(processor.image_token),
                        marks_image_tokens="mm_token_type_ids" in processor.model_input_names)


def image_names(refs: list[ImageRef], directory: Path) -> list[str]:
    """How samples.jsonl names a sample's images: a file by its absolute path; an image given as bytes is written
    once to `directory`/<sha256 prefix>.png and named by that path, so every sample's images can be opened (report.html
    shows them)."""
    import hashlib

    names = []
    for ref in refs:
        if ref.path is not None:
            names.append(str(Path(ref.path).resolve()))
            continue
        path = directory / f"{hashlib.sha256(ref.data).hexdigest()[:16]}.png"
        if not path.is_file():
            directory.mkdir(parents=True, exist_ok=True)
            ref.open().save(path, format="PNG")
        names.append(str(path.resolve()))
    return names


def narrowed(input_ids: list[int], refs: list[ImageRef], image_token_id: int) -> list[int]:
    """The inverse of RowImages.widen: each image's run of `ref.tokens` placeholder tokens back to one placeholder,
    as a prompt is written before the processor widens it (what vLLM takes with the images: it widens them itself).
    ValueError where the runs do not match the images (a prompt not widened from these refs)."""
    out, k, i = [], 0, 0
    while i < len(input_ids):
        token = input_ids[i]
        if token != image_token_id:
            out.append(token)
            i += 1
            continue
        if k == len(refs):
            raise ValueError(f"the prompt holds image tokens at position {i} past its {len(refs)} images")
        if input_ids[i : i + refs[k].tokens] != [image_token_id] * refs[k].tokens:
            raise ValueError(f"the prompt's image tokens at position {i} are not image {k}'s {refs[k].tokens} "
                             "widened placeholder tokens")
        out.append(token)
        i += refs[k].tokens
        k += 1
    if k != len(refs):
        raise ValueError(f"the prompt holds the placeholders of {k} images, but {len(refs)} images came with it")
    return out


class ImageEncoder:
    """A processor's images -> pixel tensors, for a generation engine: `encoder(images per prompt)` (vision_inputs),
    and the placeholder token the engine must not sample (a completion's own image token would have no pixels)."""

    def __init__(self, processor):
        self.processor = processor
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)

    def __call__(self, images_B: list[list[ImageRef]]) -> Optional[VisionInputs]:
        return vision_inputs(images_B, self.processor)

    def narrow(self, input_ids: list[int], refs: list[ImageRef]) -> list[int]:
        """The prompt with one placeholder per image, as vLLM takes it (`narrowed`)."""
        return narrowed(input_ids, refs, self.image_token_id)


def with_images(batch: Batch, images_B: list[list[ImageRef]], processor) -> Batch:
    """`batch` with the pixel tensors of each row's images (see vision_inputs)."""
    return dataclasses.replace(batch, vision=vision_inputs(images_B, processor))
