"""Models and tokenizers from a hub id or a local directory, LoRA adapters, parameter counts.

    check_model_source(recipe.model)                       # UserError before anything heavy loads
    tokenizer = load_tokenizer(recipe.model)               # pad token guaranteed, right padding
    model = load_causal_lm(recipe.model, gradient_checkpointing=True)
    model = apply_lora(model, recipe.model.lora)           # only with model.lora.enabled
    with disable_adapter(model):                           # the frozen base: reference log-probs for free
        ...
    plain = merge_lora(model)                              # for export

Loading only calls `from_pretrained`: under Accelerate + DeepSpeed ZeRO-3, transformers itself partitions the
weights while loading (zero.Init), so nothing here moves devices or knows about the launcher.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from posttrain.config.schema import ALL_LINEAR, LoraConfig, ModelConfig
from posttrain.distributed import sequence_parallel
from posttrain.distributed.wrappers import unwrap_module
from posttrain.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
TASKS = ("causal_lm", "seq_cls")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_MAKE_TINY = "make a local one with `posttrain make-tiny-model --out tiny/`"


def check_model_source(model_cfg: ModelConfig, what: str = "model.name_or_path") -> None:
    """Fail early when a local model (or tokenizer) path is missing or not a Hugging Face directory; anything that
    looks like a path (exists, starts with ./ ../ / ~, ends with /, more than one /) must be one."""
    _check_source(model_cfg.name_or_path, what, ("config.json",))
    if model_cfg.tokenizer_name_or_path:
        key = what.rsplit(".", 1)[0] + ".tokenizer_name_or_path" if "." in what else "tokenizer_name_or_path"
        _check_source(model_cfg.tokenizer_name_or_path, key, ("tokenizer_config.json", "tokenizer.json"))


def check_hub_sources(model_cfg: ModelConfig, what: str = "model.name_or_path") -> None:
    """Before a hub id of the recipe loads (model, tokenizer): a hub that cannot be reached is found out in seconds,
    a cached model is then read from the cache and an uncached one refused saying how to get it (models/hub.py)."""
    from posttrain.models.hub import check_hub_model

    tokenizer_key = what.rsplit(".", 1)[0] + ".tokenizer_name_or_path" if "." in what else "tokenizer_name_or_path"
    for source, key, revision in ((model_cfg.name_or_path, what, model_cfg.revision),
                                  (model_cfg.tokenizer_name_or_path, tokenizer_key, None)):
        if source and not _looks_local(source):
            check_hub_model(source, revision, key)


def _looks_local(source: str) -> bool:
    return (Path(source).expanduser().exists() or source.startswith(("./", "../", "/", "~")) or source.endswith("/")
            or _HUB_ID.match(source) is None)


def _check_source(source: str, what: str, marker_files: tuple[str, ...]) -> None:
    if not source:
        raise UserError(f"{what} is empty: give a hub id (org/name) or a local model directory; {_MAKE_TINY}")
    if not _looks_local(source):
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"{what}: local path '{source}' does not exist. Give a hub id (org/name) or a model "
                        f"directory; {_MAKE_TINY}")
    if not path.is_dir() or not any((path / name).is_file() for name in marker_files):
        raise UserError(f"{what}: '{source}' is not a Hugging Face model directory (it has no "
                        f"{' or '.join(marker_files)}). Point it at the directory written by save_pretrained (for a "
                        "finished run: <output_dir>/final)")
    from posttrain.models.limits import config_problem

    problem = config_problem(path / "config.json") if (path / "config.json").is_file() else None
    if problem:
        raise UserError(f"{what}: {path / 'config.json'} is damaged: {problem}; download or export the model again")
    for weights in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise UserError(f"{what}: {weights} is damaged ({problem}): it was cut short or overwritten; download or "
                            "export the model again")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise UserError(f"{what}: {index} lists {', '.join(missing)}, which {path} does not hold; download or "
                            "export the model again")


def safetensors_problem(path: Path) -> Optional[str]:
    """What is wrong with a .safetensors file's framing (header, and the size its header describes), or None.
    Reads the header only: a truncated download or copy shows as a size mismatch."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n < 2 or 8 + n > size:
                return f"{size} bytes: the header is cut short"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return f"unreadable header: {e}"
    return f"{size} bytes where its header describes {8 + n + end}" if 8 + n + end != size else None


def _resolve(source: str) -> str:
    """What from_pretrained gets: a hub id as is, a local path with ~ expanded."""
    return str(Path(source).expanduser()) if _looks_local(source) else source


def load_tokenizer(model_cfg: ModelConfig):
    """AutoTokenizer with the recipe's chat template override, a pad token (eos when it has none), right padding."""
    from transformers import AutoTokenizer

    check_model_source(model_cfg)
    check_hub_sources(model_cfg)
    if model_cfg.tokenizer_name_or_path:  # model.revision names a commit of the model's repository, not this one
        src, revision = _resolve(model_cfg.tokenizer_name_or_path), None
    else:
        src, revision = _resolve(model_cfg.name_or_path), model_cfg.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, revision=revision, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load the tokenizer from '{src}': {e}") from e
    if model_cfg.chat_template:
        tokenizer.chat_template = _read_chat_template(model_cfg.chat_template)
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        except Exception as e:  # jinja raises several types; all mean the template is broken
            raise UserError(f"model.chat_template does not render: {type(e).__name__}: {e}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"the tokenizer of '{src}' has neither a pad nor an eos token; set pad_token in "
                            "tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    from posttrain.models.facts import generation_eos_ids  # what ends a completion: models.facts.stop_ids

    tokenizer.posttrain_stop_ids = generation_eos_ids(_resolve(model_cfg.name_or_path), model_cfg.revision)
    return tokenizer


def _read_chat_template(value: str) -> str:
    """model.chat_template is inline Jinja, or a path to a .jinja file."""
    if "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(f"model.chat_template: '{value}' is neither a Jinja template (no {{% or {{{{ in it) nor an "
                        "existing file")
    return path.read_text()


def _from_pretrained(auto_cls, model_cfg: ModelConfig, gradient_checkpointing: bool, **extra):
    check_model_source(model_cfg)
    check_hub_sources(model_cfg)
    src = _resolve(model_cfg.name_or_path)
    if model_cfg.dtype not in DTYPES:
        raise UserError(f"model.dtype must be one of {', '.join(DTYPES)}, got '{model_cfg.dtype}'")
    try:
        model = auto_cls.from_pretrained(src, dtype=DTYPES[model_cfg.dtype], revision=model_cfg.revision,
                                         attn_implementation=model_cfg.attn_implementation,
                                         trust_remote_code=model_cfg.trust_remote_code, **extra)
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"could not load model.name_or_path '{src}': {type(e).__name__}: {e}") from e
    if gradient_checkpointing:
        # the recomputation in the backward attends as the first forward did (Ulysses under sequence parallelism)
        kwargs = {"use_reentrant": False, "context_fn": sequence_parallel.checkpoint_context}
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24, whose old name warns
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    return model


def load_causal_lm(model_cfg: ModelConfig, gradient_checkpointing: bool = False):
    """AutoModelForCausalLM from the recipe's source, dtype, attention kernel, revision; optional checkpointing. A
    vision-language model loads as AutoModelForImageTextToText (its forward takes the images and returns logits like
    a causal LM's), its vision tower and projector frozen as model.freeze_vision_tower / freeze_projector say. With
    model.lm_head_fp32 its output layer runs in float32 (fp32_output_layer)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from posttrain.models.vision import freeze_vision, is_vision_model

    if not is_vision_model(model_cfg):
        model = _from_pretrained(AutoModelForCausalLM, model_cfg, gradient_checkpointing)
    else:
        model = _from_pretrained(AutoModelForImageTextToText, model_cfg, gradient_checkpointing)
        if model_cfg.freeze_vision_tower or model_cfg.freeze_projector:
            freeze_vision(model, model_cfg.freeze_vision_tower, model_cfg.freeze_projector)
    if model_cfg.lm_head_fp32:
        fp32_output_layer(model)
    return model


FP32_HEAD = "posttrain_fp32_head"
"""Set on an output layer that fp32_output_layer made: the fused log-prob path (models/forward.py) feeds it float32."""


def _fp32_linear(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):  # autocast would run the matmul in bf16 again
        return torch.nn.functional.linear(hidden.float(), head.weight.float(),
                                          None if head.bias is None else head.bias.float())


def fp32_output_layer(model) -> None:
    """model.lm_head_fp32: the output layer's weight in float32 and its forward in float32 whatever the hidden
    states' dtype and autocast (TRL's cast_lm_head_to_fp32). A tied input embedding shares the float32 weight; its
    output is cast back to the model's dtype, so the layers after it see what they did before."""
    inner = unwrap_module(model)
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise UserError(f"model.lm_head_fp32: the output layer of {type(inner).__name__} is a "
                        f"{type(head).__name__}, not a plain Linear; set model.lm_head_fp32=false")
    dtype = head.weight.dtype
    embeddings = inner.get_input_embeddings()
    head.float()
    head.forward = _fp32_linear.__get__(head)
    setattr(head, FP32_HEAD, True)
    if embeddings is not None and embeddings.weight is head.weight and dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, args, out: out.to(dtype))


def load_sequence_classifier(model_cfg: ModelConfig, gradient_checkpointing: bool = False, pad_token_id=None):
    """A one-score head (num_labels=1) on the model (fresh from a causal-LM checkpoint). It scores each sequence at
    its last non-pad token, so config.pad_token_id must be the tokenizer's (load_tokenizer's when not given)."""
    from transformers import AutoModelForSequenceClassification

    if pad_token_id is None:
        pad_token_id = load_tokenizer(model_cfg).pad_token_id
    model = _from_pretrained(AutoModelForSequenceClassification, model_cfg, gradient_checkpointing, num_labels=1,
                             pad_token_id=pad_token_id)
    model.config.pad_token_id = pad_token_id
    return model


def apply_lora(model, lora_cfg: LoraConfig, task: str = "causal_lm"):
    """Wrap the model in peft LoRA adapters; only adapters (and, for seq_cls, the score head) stay trainable. A
    vision-language model gets them in its language model only (a CLIP tower's q_proj would match too), its vision
    tower and projector frozen."""
    try:
        import peft
    except ImportError:
        raise UserError("model.lora.enabled needs peft: pip install posttrain[peft]") from None
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    linear_names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                           if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})  # GPT-2's Conv1D too
    targets = lora_targets(lora_cfg.target_modules, getattr(model.config, "model_type", ""))
    if targets != ALL_LINEAR and not set(targets) & set(linear_names):
        raise UserError(f"model.lora.target_modules {list(lora_cfg.target_modules)} match no layer of this model; "
                        f"its linear layers are named: {', '.join(linear_names)}")
    from posttrain.models.vision import vision_modules_pattern

    config = peft.LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, bias="none",
                             target_modules=targets,
                             exclude_modules=vision_modules_pattern(model),  # a VLM: the language model only
                             task_type=peft.TaskType.CAUSAL_LM if task == "causal_lm" else peft.TaskType.SEQ_CLS)
    return peft.get_peft_model(model, config)


def lora_targets(target_modules: tuple[str, ...], model_type: str) -> list[str] | str:
    """What peft.LoraConfig(target_modules=) gets: the names, PEFT's "all-linear", or for [] PEFT's modules for the
    architecture (TRL's default: it passes None)."""
    if tuple(target_modules) == (ALL_LINEAR,):
        return ALL_LINEAR
    if target_modules:
        return list(target_modules)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as BY_ARCHITECTURE

    if model_type not in BY_ARCHITECTURE:
        raise UserError(f"model.lora.target_modules=[] takes PEFT's modules for the architecture, and PEFT has none "
                        f"for {model_type!r}: name the modules (or all-linear)")
    return list(BY_ARCHITECTURE[model_type])


def is_peft_model(model) -> bool:
    return hasattr(unwrap_module(model), "disable_adapter")


@contextlib.contextmanager
def disable_adapter(model) -> Iterator[None]:
    """Inside the block the LoRA model computes exactly as its frozen base (reference log-probs without a copy)."""
    inner = unwrap_module(model)
    if not hasattr(inner, "disable_adapter"):
        raise TypeError(f"disable_adapter needs a peft (LoRA) model, got {type(inner).__name__}")
    with inner.disable_adapter():
        yield


def merge_lora(model):
    """The plain transformers model with the adapters folded in (in place: do not train the LoRA model after)."""
    inner = unwrap_module(model)
    return inner.merge_and_unload(safe_merge=True) if hasattr(inner, "merge_and_unload") else inner


def lora_adapter(peft_model, state: Optional[dict] = None) -> tuple[Any, dict]:
    """(peft config, adapter tensors on CPU) of a LoRA model, named as peft saves them, taken before a merge folds
    them in. `state`: the LoRA model's full state dict when it was gathered from shards (else read from the model)."""
    from peft import get_peft_model_state_dict

    name = peft_model.active_adapter
    tensors = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=name)
    return (copy.deepcopy(peft_model.peft_config[name]),
            {key: t.detach().to("cpu", copy=True).contiguous() for key, t in tensors.items()})


def save_lora_adapter(directory: Path, config, tensors: dict) -> None:
    """adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes them (PeftModel.
    from_pretrained(base, directory) and vLLM's LoRA loading read them)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def merge_lora_state(peft_model, state: dict, model_class: type):
    """The plain model with the adapters folded in, built on CPU from `state` (the LoRA model's full state dict
    gathered from FSDP shards) and `peft_model`'s structure (left untouched); `model_class`: the base model's class
    (sharding may have swapped the instance's). Built on the meta device, it takes the gathered tensors as they are."""
    from peft import get_peft_model

    name = peft_model.active_adapter
    with torch.device("meta"):
        fresh = get_peft_model(model_class._from_config(peft_model.get_base_model().config),
                               copy.deepcopy(peft_model.peft_config[name]), name)
    _, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"merging LoRA from gathered weights: unexpected entries {unexpected[:5]}")
    fresh.get_base_model().tie_weights()  # a tied lm_head was gathered once, under the embedding's name
    buffers = dict(peft_model.named_buffers())  # buffers are not sharded; non-persistent ones are in no state dict
    for key, buffer in list(fresh.named_buffers()):
        if buffer.is_meta:
            module_name, _, leaf = key.rpartition(".")
            fresh.get_submodule(module_name).register_buffer(leaf, buffers[key].detach().to("cpu", copy=True),
                                                             persistent=False)
    still_meta = [n for n, p in fresh.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"merging LoRA from gathered weights: no values for {still_meta[:5]}")
    return fresh.merge_and_unload(safe_merge=True)


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable) parameter counts; shared (tied) weights once; full sizes under ZeRO-3 partitioning."""
    sizes = [(getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for p in model.parameters()]
    return sum(n for n, _ in sizes), sum(n for n, trains in sizes if trains)
