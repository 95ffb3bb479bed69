"""The teacher of a distillation run: a frozen causal LM beside the student, loaded like the reference.

    teacher_cfg = teacher_model_config(recipe.model, "Qwen/Qwen2.5-7B-Instruct")
    check_same_vocabulary(recipe.model, teacher_cfg)     # config + tokenizer files only, before any weights
    teacher = make_reference(teacher_cfg)                 # eval mode, no gradients (models/reference.py)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from posttrain.config.schema import LoraConfig, ModelConfig
from posttrain.errors import UserError
from posttrain.models.load import _resolve, check_model_source, load_tokenizer

TEACHER_KEY = "algo.teacher_model_name_or_path"


def teacher_model_config(student: ModelConfig, name_or_path: str, revision: Optional[str] = None) -> ModelConfig:
    """The student's loading settings (dtype, attention kernel, trust_remote_code) for the teacher's weights; no LoRA,
    and its own tokenizer files (which check_same_vocabulary compares with the student's)."""
    return dataclasses.replace(student, name_or_path=name_or_path, revision=revision, tokenizer_name_or_path=None,
                               lora=LoraConfig())


def _vocab_size(cfg: ModelConfig) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(_resolve(cfg.name_or_path), revision=cfg.revision,
                                        trust_remote_code=cfg.trust_remote_code)
    return config.get_text_config().vocab_size


def check_same_vocabulary(student: ModelConfig, teacher: ModelConfig) -> None:
    """UserError naming both models unless their output layers index the same tokens: equal vocab_size in config.json
    and the same token -> id mapping in their tokenizers. Reads config and tokenizer files only."""
    check_model_source(student)
    check_model_source(teacher, TEACHER_KEY)
    both = f"the teacher ({TEACHER_KEY}={teacher.name_or_path}) and the student (model.name_or_path=" \
           f"{student.name_or_path})"
    advice = ("distillation compares the two models' next-token distributions token by token, so they must share a "
              "tokenizer and vocabulary; pick a teacher of the student's family (or a student of the teacher's)")
    sizes = _vocab_size(student), _vocab_size(teacher)
    if sizes[0] != sizes[1]:
        raise UserError(f"{both} have vocabularies of {sizes[1]} and {sizes[0]} tokens (vocab_size in config.json): "
                        f"{advice}")
    student_vocab, teacher_vocab = load_tokenizer(student).get_vocab(), load_tokenizer(teacher).get_vocab()
    if student_vocab != teacher_vocab:
        differ = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda kv: kv[1])[:3]
        raise UserError(f"{both} have different tokenizers ({len(teacher_vocab)} and {len(student_vocab)} tokens; "
                        f"e.g. token -> id {differ} is in one only): {advice}")
