"""How a run holds and computes its weights: mixed precision by default, pure bf16 / fp16 only when asked.

    precision = resolve_precision(recipe.model, recipe.train)   # before any weights load (reads config.json)
    precision.autocast                   # 'no' | 'bf16' | 'fp16': the run's Accelerate mixed_precision
    load_cfg = trained_model_config(recipe.model, recipe.train)  # what the policy / critic load with
    announce_precision(precision, on_cpu=True)                   # the one-time notes (pure bf16, slow CPU)

A 16-bit checkpoint (model.dtype bfloat16 / float16, or auto on a checkpoint saved in one) is trained as mixed
precision does it (accelerate's `mixed_precision: bf16`, DeepSpeed's bf16 mode, FSDP2's MixedPrecisionPolicy): the
trained weights and AdamW's state in float32 (the "master weights"), matmuls under 16-bit autocast. Without them an
AdamW step moves a weight by about lr, and bf16 keeps 8 bits of mantissa: any update below ~1/256 of a weight rounds
back to the same bf16 value, so with lr 3e-5 most of a model never changes (measured on SmolLM2-135M: loss 0.574
after 4 SFT steps against 0.147 in float32). `train.master_weights: false` asks for pure 16-bit training (LLaMA-
Factory's `pure_bf16`): weights, gradients and AdamW state in the checkpoint's dtype, 8 bytes per trained weight
instead of 16, and the update loss above. Frozen models (reference, teacher, reward model) load as model.dtype says.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from posttrain.config.schema import ModelConfig, TrainConfig
from posttrain.errors import UserError

LOW_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}  # weights dtype -> the autocast that computes in it
_ANNOUNCED: set[str] = set()  # notes said in this process


@dataclass(frozen=True)
class Precision:
    """One run's precision, resolved once from the recipe and the checkpoint."""

    loaded: str
    """The checkpoint's dtype as the recipe loads it (model.dtype, auto resolved): float32, bfloat16 or float16."""
    trained: str
    """The dtype the trained weights and their AdamW state are held in (float32 unless pure 16-bit was asked for)."""
    autocast: str
    """The run's autocast: 'no', 'bf16' or 'fp16' (train.mixed_precision, or the 16-bit checkpoint's)."""

    @property
    def pure(self) -> bool:
        """Trained weights held in 16 bits (train.master_weights=false on a 16-bit checkpoint)."""
        return self.trained in LOW_PRECISION

    @property
    def uses_bf16(self) -> bool:
        return "bfloat16" in (self.loaded, self.trained) or self.autocast == "bf16"


def checkpoint_dtype(model_cfg: ModelConfig) -> str:
    """model.dtype with auto resolved to the dtype the checkpoint was saved in (config.json's dtype / torch_dtype;
    float32 when it names none). Reads the config only."""
    if model_cfg.dtype != "auto":
        return model_cfg.dtype
    config_file = Path(model_cfg.name_or_path).expanduser() / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        text = config.get("text_config") or {}  # multimodal configs keep the language model's dtype there
        saved = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    else:  # a hub id: transformers reads (and caches) its config
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_cfg.name_or_path, revision=model_cfg.revision,
                                            trust_remote_code=model_cfg.trust_remote_code)
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    saved = str(saved).replace("torch.", "") if saved else "float32"
    return saved if saved in ("float32", "bfloat16", "float16") else "float32"


def resolve_precision(model_cfg: ModelConfig, train: TrainConfig) -> Precision:
    """The run's precision: a 16-bit checkpoint trains with float32 master weights under its own autocast (unless
    train.mixed_precision names another), or, with train.master_weights=false, in its own dtype."""
    loaded = checkpoint_dtype(model_cfg)
    if loaded not in LOW_PRECISION:
        return Precision(loaded=loaded, trained=loaded, autocast=train.mixed_precision)
    if not train.master_weights:
        return Precision(loaded=loaded, trained=loaded, autocast=train.mixed_precision)
    autocast = train.mixed_precision if train.mixed_precision != "no" else LOW_PRECISION[loaded]
    return Precision(loaded=loaded, trained="float32", autocast=autocast)


def check_master_weights(model_cfg: ModelConfig, train: TrainConfig) -> None:
    """train.master_weights=false asks for pure 16-bit training: on float32 weights there is nothing 16-bit to train
    (train.mixed_precision autocasts the compute only), so the key would silently mean nothing. Reads config.json
    for model.dtype=auto; before any weights load."""
    if train.master_weights:
        return
    try:
        loaded = checkpoint_dtype(model_cfg)
    except (OSError, ValueError):  # a hub id whose config cannot be read here: loading it says why
        return
    if loaded in LOW_PRECISION:
        return
    source = (f"model.dtype=auto reads {loaded} from {model_cfg.name_or_path}'s config" if model_cfg.dtype == "auto"
              else f"model.dtype={loaded}")
    autocast = (f" (train.mixed_precision={train.mixed_precision} autocasts the compute only)"
                if train.mixed_precision != "no" else "")
    raise UserError(f"train.master_weights=false asks for pure 16-bit weights, but {source}: the trained weights are "
                    f"{loaded}{autocast}. Set model.dtype=bfloat16 (or float16) to train in 16 bits, or drop "
                    "train.master_weights=false")


def trained_model_config(model_cfg: ModelConfig, train: TrainConfig) -> ModelConfig:
    """`model_cfg` with the dtype a trained model (policy, critic) loads in: float32 master weights for a 16-bit
    checkpoint unless train.master_weights=false. With LoRA the frozen base stays 16-bit (`upcast_trainable` then
    holds the adapters in float32), as peft and TRL do."""
    if model_cfg.lora.enabled:
        return model_cfg
    return dataclasses.replace(model_cfg, dtype=resolve_precision(model_cfg, train).trained)


def upcast_trainable(model, model_cfg: ModelConfig, train: TrainConfig):
    """The trainable parameters of a model on a 16-bit base (LoRA adapters, a new score head) in float32, where the
    run keeps master weights; the frozen ones as loaded. Returns the model."""
    if resolve_precision(model_cfg, train).trained == "float32":
        for param in model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
    return model


def export_dtype(train: TrainConfig, precision: Precision) -> str:
    """final/'s weights dtype: train.export_dtype, auto being the dtype the model was loaded in."""
    return precision.loaded if train.export_dtype == "auto" else train.export_dtype


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> Optional[bool]:
    """Whether this CPU computes bf16 natively (x86 avx512_bf16 / amx_bf16, Arm bf16), from /proc/cpuinfo's flags;
    None where that cannot be read (then nothing is said)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    if not flags:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def check_precision(precision: Precision, on_cpu: bool, engine: Optional[str]) -> None:
    """UserError for a precision this launch cannot run, before any model loads."""
    if on_cpu and precision.autocast == "fp16":
        fix = ("model.dtype=bfloat16, or train.master_weights=false for pure fp16" if precision.loaded == "float16"
               else "bf16 or 'no'")
        where = ("model.dtype=float16 trains with float32 master weights under fp16 autocast, which"
                 if precision.loaded == "float16" and precision.trained == "float32" else "train.mixed_precision=fp16")
        raise UserError(f"{where} needs a CUDA GPU; on CPU use {fix}")
    if precision.pure and engine == "deepspeed":
        raise UserError("train.master_weights=false (pure 16-bit training) is not available under DeepSpeed, whose "
                        "bf16 / fp16 modes always keep float32 master weights: drop train.master_weights=false")


def precision_notes(precision: Precision, on_cpu: bool, native_bf16: Optional[bool]) -> list[str]:
    """What a run says once at start about its precision: pure 16-bit training and its cost; bf16 on a CPU that
    emulates it."""
    notes = []
    if precision.pure:
        notes.append("train.master_weights=false: the trained weights, gradients and AdamW state are "
                     f"{precision.trained} (pure 16-bit training, 8 bytes per weight instead of 16). An update "
                     "smaller than ~1/256 of a weight rounds away, so small learning rates train little or nothing; "
                     "drop train.master_weights=false for float32 master weights")
    if on_cpu and precision.uses_bf16 and native_bf16 is False:
        notes.append("this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag): bf16 compute is emulated and a "
                     "step can take 10-20x longer than in float32 (126 s against 7 s on SmolLM2-135M, AVX2). "
                     "model.dtype=float32 with train.mixed_precision=no is the fast choice here")
    return notes


def announce_precision(precision: Precision, on_cpu: bool) -> None:
    """Say each precision note once per process (rank 0)."""
    from posttrain.errors import warn

    for note in precision_notes(precision, on_cpu, cpu_has_native_bf16() if on_cpu else None):
        if note not in _ANNOUNCED:
            _ANNOUNCED.add(note)
            warn(note)
