"""``DigitsDataModule``: scikit-learn's bundled 8x8 handwritten digits, for small examples.

1,797 grey-level images of the digits 0-9, shipped inside scikit-learn (nothing to
download). Pixels are scaled from 0..16 to 0..1; a seeded permutation splits off the
last ``val_fraction`` for validation. ``as_images=True`` gives ``(1, 8, 8)`` tensors for
conv nets, otherwise flat vectors of 64.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["DigitsDataModule"]


class DigitsDataModule(L.LightningDataModule):
    """Train and validation loaders over scikit-learn's digits (needs ``scikit-learn``).

    Args:
        batch_size: samples per batch.
        val_fraction: share of the 1,797 images held out for validation, in (0, 1).
        as_images: ``(N, 1, 8, 8)`` images instead of ``(N, 64)`` vectors.
        seed: the split's permutation.
    """

    num_classes = 10

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, as_images: bool = False, seed: int = 0) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.as_images = as_images
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:  # pragma: no cover - scikit-learn is in the dev extra
            raise ImportError("DigitsDataModule needs scikit-learn: pip install scikit-learn") from err
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # (1797, 64)
        y = torch.tensor(digits.target, dtype=torch.long)
        if self.as_images:
            x = x.view(-1, 1, 8, 8)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        split = len(x) - int(len(x) * self.val_fraction)
        self.train_set = TensorDataset(x[perm[:split]], y[perm[:split]])
        self.val_set = TensorDataset(x[perm[split:]], y[perm[split:]])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)
