"""Keep fewer activations for the backward pass, with bit-identical gradients: what an op saves that is one cheap
elementwise op away from another saved tensor is recomputed in the backward instead of kept.

Autograd keeps, per decoder layer of a Llama-style model, four (tokens x intermediate) tensors for the gated MLP
`down(act(gate(x)) * up(x))`: gate(x) (for act's backward), act(gate(x)) and up(x) (for the product's) and the
product (for down's weight gradient); and two (tokens x hidden) tensors for each RMSNorm: the normalised input and
its cast (for the weight's gradient). Only gate(x), up(x), the norm's input and its 1/rms are needed: act(gate(x)),
the product and the normalised input are made again from them when the backward asks (a saved-tensors hook, so
autograd's own backward formulas run on bitwise the same values: the gradients do not change, only when these few
elementwise ops run). On SmolLM2-135M at 8 x 256 tokens that is ~1 GB of the ~2.6 GB of activations.

    with lean_activations(model):
        logits = model(**inputs).logits      # loss.backward() may run after the block: the hooks are on the graph

Applied to the modules whose class's own forward is exactly the Llama formula (checked on its source, so a
transformers release that changes it, or a kernel that replaced it, is left alone), and only while gradients are
recorded and gradient checkpointing is off (checkpointing already drops these tensors, through hooks of its own).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch.autograd.graph import saved_tensors_hooks

from posttrain.distributed.wrappers import unwrap_module

MLP_SOURCE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
NORM_SOURCE = ("hidden_states = hidden_states.to(torch.float32)",
               "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
               "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
               "return self.weight * hidden_states.to(input_dtype)")


@functools.lru_cache(maxsize=None)
def _kind(cls: type) -> str | None:
    """'mlp' or 'norm' when `cls.forward` is the formula this module re-states; else None."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    if MLP_SOURCE in source:
        return "mlp"
    if all(line in source for line in NORM_SOURCE):
        return "norm"
    return None


def _recomputed(target: torch.Tensor, remake):
    """Saved-tensor hooks that store, instead of any view of `target`'s storage, a note to remake it: `remake()`
    returns a tensor laid out as `target` (same size, strides), whose view is then taken again. The hooks hold no
    reference to `target` (autograd keeps both hooks as long as the graph), so it is freed after the forward."""
    storage, dtype, base = target.untyped_storage().data_ptr(), target.dtype, target.storage_offset()

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == storage and t.dtype == dtype:
            return (t.size(), t.stride(), t.storage_offset() - base)
        return t

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        size, stride, offset = saved
        return remake().as_strided(size, stride, offset)

    return saved_tensors_hooks(pack, unpack)


def _mlp_forward(module):
    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = module.gate_proj(x), module.up_proj(x)
        act = module.act_fn(gate)  # act saves gate, kept anyway
        with _recomputed(act, lambda: module.act_fn(gate)):
            product = act * up  # saves act (remade) and up
        with _recomputed(product, lambda: module.act_fn(gate) * up):
            return module.down_proj(product)  # saves the product (remade) and its weight

    return forward


def _norm_forward(module):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        inv_rms = torch.rsqrt(variance + module.variance_epsilon)
        normed = (hidden_states * inv_rms).to(input_dtype)  # the product saves the input and inv_rms, kept anyway
        with _recomputed(normed, lambda: (hidden_states * inv_rms).to(input_dtype)):
            return module.weight * normed

    return forward


FORWARDS = {"mlp": _mlp_forward, "norm": _norm_forward}


def checkpointing(model: torch.nn.Module) -> bool:
    """Gradient (activation) checkpointing is on in some layer: what transformers' `is_gradient_checkpointing`
    answered, read from the layers' own flag, since transformers 5.24 deprecates that property with a FutureWarning
    on every read (every step of a healthy run) in favour of `is_activation_checkpointing`, absent before."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


@contextlib.contextmanager
def lean_activations(model):
    """For the duration of the block, the model's gated MLPs and RMSNorms keep only what their backward cannot
    cheaply remake (module docstring). A no-op without gradients or under gradient checkpointing."""
    inner = unwrap_module(model)
    if not torch.is_grad_enabled() or not inner.training or checkpointing(inner):
        yield
        return
    swapped = []
    for module in inner.modules():
        kind = _kind(type(module))
        if kind is not None and "forward" not in vars(module):
            module.forward = FORWARDS[kind](module)
            swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            del module.forward


def lean_kinds(config) -> frozenset:
    """The kinds of module ('mlp', 'norm') that lean_activations remakes in a model of this config, read from the
    classes of transformers' modeling module for its model_type, so the planner counts what a run keeps without
    building the model. Empty where that module cannot be read (remote code, a type transformers lacks): the planner
    then counts every activation, the larger figure."""
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(getattr(config, "model_type", None) or "")
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except Exception:  # noqa: BLE001 - any import failure means "not known": the larger estimate
        return frozenset()
    kinds = {_kind(cls) for cls in vars(module).values()
             if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == module.__name__}
    return frozenset(kinds - {None})
