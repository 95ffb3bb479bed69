"""models.lean_activations: the same loss and bit-identical gradients with fewer saved activations, on the tiny Llama
(fp32, bf16 autocast, padded rows, and a pure bf16 model)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models.lean_activations import lean_activations


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return m.train()


def inputs(vocab: int, padded: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 9:] = 0
    return dict(input_ids=ids, attention_mask=mask, use_cache=False)


def loss_grads_saved(model, batch, lean: bool, autocast: bool):
    """The loss, every parameter's gradient and the bytes autograd keeps for the backward."""
    model.zero_grad(set_to_none=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", enabled=autocast):
        if lean:
            with lean_activations(model):
                logits = model(**batch).logits
        else:
            logits = model(**batch).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())


@pytest.mark.parametrize("autocast,padded", [(False, False), (False, True), (True, True)])
def test_gradients_are_bit_identical_and_fewer_bytes_are_kept(model, autocast, padded):
    batch = inputs(model.config.vocab_size, padded)
    loss, grads, saved = loss_grads_saved(model, batch, lean=False, autocast=autocast)
    lean_loss, lean_grads, lean_saved = loss_grads_saved(model, batch, lean=True, autocast=autocast)
    assert torch.equal(loss, lean_loss)
    assert grads.keys() == lean_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], lean_grads[name]), name
    # per layer and token: 2 of the MLP's 4 intermediate-wide tensors, 1 of each RMSNorm's hidden-wide ones
    c = model.config
    width = 4 if not autocast else 2  # the MLP runs in bf16 under autocast; the norms stay float32
    dropped = c.num_hidden_layers * 3 * 17 * (2 * c.intermediate_size * width + 2 * c.hidden_size * 4)
    assert saved - lean_saved >= dropped


def test_pure_bf16_model_is_bit_identical(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).train()
    batch = inputs(model.config.vocab_size, padded=True)
    loss, grads, _ = loss_grads_saved(model, batch, lean=False, autocast=False)
    lean_loss, lean_grads, _ = loss_grads_saved(model, batch, lean=True, autocast=False)
    assert torch.equal(loss, lean_loss)
    assert all(torch.equal(grads[n], lean_grads[n]) for n in grads)


def test_only_while_gradients_are_recorded_and_restored_after(model):
    mlp = model.model.layers[0].mlp
    with lean_activations(model):
        assert "forward" in vars(mlp) and "forward" in vars(model.model.norm)
    assert "forward" not in vars(mlp) and "forward" not in vars(model.model.norm)
    with torch.no_grad(), lean_activations(model):
        assert "forward" not in vars(mlp)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        with lean_activations(model):
            assert "forward" not in vars(mlp)
    finally:
        model.gradient_checkpointing_disable()


def test_reading_whether_checkpointing_is_on_warns_nothing_under_transformers_5_24(model, monkeypatch):
    """transformers 5.24 made PreTrainedModel.is_gradient_checkpointing a deprecated alias that warns FutureWarning
    on every read: every Llama-family step of a healthy run printed it. Its property is put in here as 5.24 has it."""
    import warnings

    def deprecated(self):
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                      "`is_activation_checkpointing` instead.", FutureWarning)
        return any(getattr(m, "gradient_checkpointing", False) for m in self.modules())

    monkeypatch.setattr(type(model), "is_gradient_checkpointing", property(deprecated), raising=False)
    mlp = model.model.layers[0].mlp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lean_activations(model):
            assert "forward" in vars(mlp)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            with lean_activations(model):
                assert "forward" not in vars(mlp)  # still off under checkpointing
        finally:
            model.gradient_checkpointing_disable()
