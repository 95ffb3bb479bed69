"""Data: load rows (files, save_to_disk directories, hub), detect TRL formats, tokenise with loss masks, collate.

    rows = load_rows(recipe.data.train, recipe.data.train_split, "data.train")
    examples, stats = tokenize_sft(rows, tokenizer, recipe.data, "data.train")
    batch = collate_packed(examples[:8]) if recipe.data.packing else collate_padded(examples[:8], pad_id)
"""

from posttrain.data.collate import collate_packed, collate_padded, collate_preference, collate_prompts, eval_batches
from posttrain.data.formats import DataFormat, detect_format
from posttrain.data.images import ImageRef, RowImages, vision_inputs, with_images
from posttrain.data.io import load_rows, rename_text_field
from posttrain.data.tokenize import tokenize_preference, tokenize_prompts, tokenize_sft

__all__ = ["ImageRef", "RowImages", "vision_inputs", "with_images", "eval_batches", "DataFormat", "collate_packed", "collate_padded", "collate_preference", "collate_prompts",
           "detect_format", "load_rows", "rename_text_field", "tokenize_preference", "tokenize_prompts", "tokenize_sft"]
