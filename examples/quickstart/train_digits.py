"""Quickstart: a plain PyTorch loop on scikit-learn's bundled digits, Muon vs AdamW.

Run: python examples/quickstart/train_digits.py [--epochs 30]

The only change from an AdamW script is the optimizer line: ``Muon(model.named_parameters())``
sends the matrices to Muon and the biases to AdamW. Names like ``lm_head`` or
``classifier`` would send a head to AdamW too; this ``nn.Sequential``'s last layer is
``4``, so it goes to Muon (``route_parameters(model)``, as the Lightning mixin routes,
finds it as the last ``nn.Linear``).
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

from lightning_muon import Muon


def load_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def train(optimizer_name: str, epochs: int, batch_size: int = 64, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    x_train, y_train, x_val, y_val = load_data()
    model = make_model()
    if optimizer_name == "muon":
        optimizer = Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        perm = torch.randperm(len(x_train))
        for start in range(0, len(x_train), batch_size):
            idx = perm[start : start + batch_size]
            loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        logits = model(x_val)
        val_loss = nn.functional.cross_entropy(logits, y_val).item()
        accuracy = (logits.argmax(-1) == y_val).float().mean().item()
    return val_loss, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    for name in ("muon", "adamw"):
        val_loss, accuracy = train(name, args.epochs)
        print(f"{name:>6}: validation loss {val_loss:.4f}, accuracy {accuracy:.2%} after {args.epochs} epochs")


if __name__ == "__main__":
    main()
