"""Whether a model's attention keeps packed sequences apart (`data.packing`), asked before anything loads.

    check_packing(recipe)      # UserError naming the architecture when its packed forwards would mix sequences

`data.packing` runs forwards on sequences concatenated in one row, position ids restarting at each; transformers keeps
attention inside each sequence for the architectures whose mask reads those position ids (Llama, Qwen, GPT-2,
GPT-NeoX, Phi, ...). Others attend across the whole row (OPT, Falcon, MPT, Bloom on transformers 5.19, measured):
every packed sequence after the first would train on its neighbours' tokens, with no error. No list is kept: a
random model of the same config, made narrow (hidden size 8 per head), answers by scoring a sequence alone and the
same sequence packed after another. Where no such model can be built here (a config transformers cannot instantiate
as a causal LM, flash-attention on a machine without it) nothing is refused.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

from posttrain.errors import UserError

HEAD_DIM = 8  # the probe's width per head: the architecture's attention, not its size, is what is asked
WIDE_KEYS = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "moe_intermediate_size", "shared_expert_intermediate_size")


def narrow(config):
    """A copy of `config` whose model is small enough to build in a moment: the same layers, heads and attention,
    at most 4 experts."""
    config = copy.deepcopy(config)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return None
    config.hidden_size = heads * HEAD_DIM
    special = [getattr(config, f"{name}_token_id", None) for name in ("pad", "bos", "eos", "decoder_start")]
    ids = [i for value in special for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)]
    smaller = {"head_dim": HEAD_DIM, "word_embed_proj_dim": config.hidden_size,
               **{key: 2 * config.hidden_size for key in WIDE_KEYS},
               "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "vocab_size": max([64, *(i + 1 for i in ids)])}
    for key, value in smaller.items():
        if isinstance(getattr(config, key, None), int) and getattr(config, key) > value:
            with contextlib.suppress(AttributeError):  # derived (a property without a setter): it follows
                setattr(config, key, value)
    return config


def packs_apart(config, attn_implementation: str = "sdpa") -> Optional[bool]:
    """True when a model of `config`'s architecture scores a sequence packed after another as it scores it alone,
    False when it does not, None when no such model can be built or run here."""
    import torch
    from transformers import AutoModelForCausalLM

    first, second = torch.arange(3, 8)[None], torch.arange(10, 17)[None]
    try:
        small = narrow(config)
        if small is None:
            return None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(small, attn_implementation=attn_implementation,
                                                     dtype=torch.float32).eval()
        with torch.no_grad():
            alone = model(input_ids=second, position_ids=torch.arange(7)[None], use_cache=False).logits
            packed = model(input_ids=torch.cat([first, second], 1), use_cache=False,
                           position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None]).logits[:, 5:]
    except Exception:  # noqa: BLE001 - a config this probe cannot build is not the user's error
        return None
    return bool(torch.allclose(alone, packed, atol=1e-4))


def check_packing(recipe) -> None:
    """data.packing=true on a model whose attention would mix the packed sequences: exit 2, naming it."""
    if not recipe.data.packing or recipe.model.attn_implementation.startswith("flash"):
        return
    from transformers import AutoConfig

    from posttrain.models.limits import model_config_file

    config_file = model_config_file(recipe.model.name_or_path, getattr(recipe.model, "revision", None))
    if config_file is None:
        return
    try:
        config = AutoConfig.from_pretrained(config_file.parent)
    except Exception:  # noqa: BLE001 - loading the model says what is wrong with its config
        return
    if packs_apart(config, recipe.model.attn_implementation) is False:
        raise UserError(f"data.packing=true: {type(config).__name__} ({recipe.model.name_or_path}) does not keep "
                        "packed sequences apart: with attn_implementation="
                        f"{recipe.model.attn_implementation} each sequence would attend to the ones packed before it "
                        "and train on them. Set data.packing=false (padded batches; the update is the same)")
