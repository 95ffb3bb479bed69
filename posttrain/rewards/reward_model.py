"""A trained reward model as a reward function: one scalar per prompt + completion.

    scorer = RewardModelScorer("runs/rm/final", device="cuda", batch_size=16)
    scorer(["What is 2 + 3?"], [" 5"])                                  # plain prompts: prompt + completion text
    scorer([[{"role": "user", "content": "Hi"}]], ["Hello!"])           # messages: the chat template, completion as
                                                                         # the assistant turn
In a recipe: `{name: reward_model, kwargs: {path: runs/rm/final}}`; the model loads once per process, at start-up.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import torch
from torch.nn.utils.rnn import pad_sequence

from posttrain.config.schema import ModelConfig
from posttrain.errors import UserError
from posttrain.models.load import check_model_source, load_sequence_classifier, load_tokenizer


class RewardModelScorer:
    """Scores text with an AutoModelForSequenceClassification (num_labels 1) saved as a Hugging Face directory.

    model_dir: `posttrain rm`'s final/, or a hub id. device: cuda when available, else cpu. max_length: keep the last
    this many tokens of each text (the score reads the end). dtype: weights dtype (auto: as saved).
    """

    def __init__(self, model_dir: str, device: Optional[str] = None, batch_size: int = 8,
                 max_length: Optional[int] = None, dtype: str = "auto"):
        from transformers import AutoConfig

        if batch_size < 1:
            raise UserError(f"reward_model: batch_size must be >= 1, got {batch_size}")
        source = ModelConfig(name_or_path=str(model_dir), dtype=dtype)
        check_model_source(source, what="reward_model kwargs.path")
        try:
            config = AutoConfig.from_pretrained(str(Path(model_dir).expanduser()))
        except (OSError, ValueError) as e:
            raise UserError(f"reward_model kwargs.path: cannot read the model config of '{model_dir}': {e}") from None
        architectures = getattr(config, "architectures", None) or []
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise UserError(f"{model_dir} holds a {architectures[0]}, not a reward model (a *ForSequenceClassification "
                            "with one label, as `posttrain rm` writes); its score head would be random")
        if config.num_labels != 1:
            raise UserError(f"{model_dir} has {config.num_labels} labels; a reward model has exactly one (num_labels 1)")
        # The loaders `posttrain rm` trains with: same pad token, so the head reads the same last token.
        self.source = source
        self.tokenizer = load_tokenizer(source)
        self.device = torch.device(device) if device else None
        self.device_given = device is not None
        self._model = None
        self.pad_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size
        self.max_length = max_length

    def load_model(self):
        """The classifier's weights, as `posttrain rm` saved them (not yet placed on a device)."""
        return load_sequence_classifier(self.source, pad_token_id=self.pad_id).eval()

    def place(self, model, device) -> None:
        """Score with `model` (what the backend made of load_model(): a partitioned engine, an offloaded module) on
        `device`. A run places its reward models after the backend exists; used alone, the scorer loads on first
        call."""
        self._model, self.device = model, torch.device(device)

    @property
    def model(self):
        if self._model is None:
            device = self.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self.place(self.load_model().to(device), device)
        return self._model

    def encode(self, prompt, completion) -> list[int]:
        """Token ids of prompt + completion exactly as `posttrain rm` tokenised its pairs (posttrain.data), so the
        head reads the token it was trained to read (EOS, or the chat template's end-of-turn token). A message-list
        prompt or completion (TRL's conversational shape, a multi-turn trajectory) is rendered by the chat
        template."""
        from posttrain.data.chat import split_rendered
        from posttrain.data.tokenize import _ids, _with_eos

        tok = self.tokenizer
        if isinstance(prompt, str) and isinstance(completion, str):
            ids = _ids(tok, prompt, True) + _with_eos(tok, _ids(tok, completion, False))
        else:
            opening = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            turn = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
            prompt_text, completion_text = split_rendered(tok, opening, turn, "reward_model")
            ids = _ids(tok, prompt_text, False) + _ids(tok, completion_text, False)
        return ids[-self.max_length:] if self.max_length else ids

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        encoded = [self.encode(p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start:start + self.batch_size]
            rows = [torch.tensor(ids, dtype=torch.long) for ids in chunk]
            input_ids = pad_sequence(rows, batch_first=True, padding_value=self.pad_id)  # right padding
            attention_mask = pad_sequence([torch.ones_like(row) for row in rows], batch_first=True)
            model = self.model
            with torch.no_grad():
                logits = model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores


_SCORERS: dict[tuple, RewardModelScorer] = {}
_SCORERS_LOCK = threading.Lock()


def load_scorer(path: str, device: Optional[str] = None, batch_size: int = 8, max_length: Optional[int] = None,
                dtype: str = "auto") -> RewardModelScorer:
    """One scorer per directory and settings per process: the recipe's reward_model entry loads its model once."""
    local = Path(path).expanduser()
    key = (str(local.resolve()) if local.exists() else path, device, batch_size, max_length, dtype)
    with _SCORERS_LOCK:
        if key not in _SCORERS:
            _SCORERS[key] = RewardModelScorer(*key)
        return _SCORERS[key]


def reward_model(prompts: list, completions: list, path: str, device: Optional[str] = None, batch_size: int = 8,
                 max_length: Optional[int] = None, dtype: str = "auto", **kwargs) -> list[float]:
    """The built-in `reward_model` reward: the score of the reward model at `path` (see RewardModelScorer)."""
    return load_scorer(path, device, batch_size, max_length, dtype)(prompts, completions)
