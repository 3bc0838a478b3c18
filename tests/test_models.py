"""CharGPT: shapes, causality, weight tying, parameter names, a short training run."""

from __future__ import annotations

import pytest
import torch

from lightning_muon_demo.models import CharGPT

TINY = {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    model = CharGPT(**TINY)
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    assert logits.dtype == torch.float32
    assert model(idx[:, :5]).shape == (3, 5, 256)
    loss = model.loss(logits, idx)
    assert loss.ndim == 0
    # Freshly initialized logits are near zero: the loss starts near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_causal_future_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = CharGPT(**TINY).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_parameter_names_and_shapes():
    model = CharGPT(**TINY)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    d = 32
    expected = {
        "tok_emb.weight": (256, d),
        "pos_emb.weight": (16, d),
        "blocks.0.ln1.weight": (d,),
        "blocks.0.attn.qkv.weight": (3 * d, d),
        "blocks.0.attn.qkv.bias": (3 * d,),
        "blocks.0.attn.proj.weight": (d, d),
        "blocks.1.ln2.bias": (d,),
        "blocks.1.mlp.fc1.weight": (4 * d, d),
        "blocks.1.mlp.fc2.weight": (d, 4 * d),
        "ln_f.weight": (d,),
        "lm_head.weight": (256, d),
    }
    for name, shape in expected.items():
        assert shapes[name] == shape, name
    assert "lm_head.bias" not in shapes
    assert model.get_output_embeddings() is model.lm_head
    assert model.get_input_embeddings() is model.tok_emb


def test_init_std_and_zero_biases():
    torch.manual_seed(0)
    model = CharGPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    assert abs(model.blocks[0].mlp.fc1.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].mlp.fc2.weight.std().item() - 0.02 / 8**0.5) < 0.001
    for name, p in model.named_parameters():
        if name.endswith("bias") and ".ln" not in name and not name.startswith("ln_f"):
            assert torch.count_nonzero(p) == 0, name


def test_tied_weights_share_storage():
    model = CharGPT(**TINY, tie_weights=True)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    untied = CharGPT(**TINY)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    # Gradients from both uses land in the one tensor.
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    assert model.tok_emb.weight.grad is not None


def test_loss_decreases_with_adamw():
    torch.manual_seed(0)
    text = torch.tensor(list(b"abcabdabcabdabcabdabcabdabcabdabcabd" * 4))
    model = CharGPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    starts = torch.arange(0, len(text) - 17, 7)
    x = torch.stack([text[s : s + 16] for s in starts])
    y = torch.stack([text[s + 1 : s + 17] for s in starts])
    losses = []
    for _ in range(30):
        loss = model.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_generate_appends_tokens():
    torch.manual_seed(0)
    model = CharGPT(**TINY).eval()
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 20, temperature=0.8)
    assert out.shape == (2, 23)
    greedy = model.generate(torch.zeros(1, 20, dtype=torch.long), 4, temperature=0)
    assert torch.equal(greedy, model.generate(torch.zeros(1, 20, dtype=torch.long), 4, temperature=0))


def test_sequence_longer_than_block_size_raises():
    model = CharGPT(**TINY)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="idx"):
        model(torch.zeros(17, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"block_size": 0}, "block_size"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": 0}, "n_head"),
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"tie_weights": 1}, "tie_weights"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CharGPT(**kwargs)
