"""Character-level (byte-level) language-modelling data for the demo model.

``CharTextDataModule`` turns one text corpus into next-token prediction windows::

    text --UTF-8--> bytes b_0 b_1 ... b_{N-1}             # tokens are byte values, vocab 256
    train = b_0 .. b_{N_train-1},  val = b_{N_train} .. b_{N-1}
    N_val = floor(N * val_fraction)                       # the LAST fraction is validation
    window at offset o:  input = b_o .. b_{o+T-1},  target = b_{o+1} .. b_{o+T}

Choices, and why:

* **Bytes, not a character set.** The vocabulary is the 256 byte values of the
  UTF-8 encoding, fixed for every corpus: no vocabulary file, no dependence on
  which characters a corpus happens to contain, so a model trained on one text
  loads and runs on another. A non-ASCII character costs two to four tokens,
  which hardly matters for source code.
* **Split by position, without randomness.** The last ``val_fraction`` of the
  token stream is validation. No window of one split reads a token of the
  other (training offsets stop ``block_size + 1`` tokens before the boundary).
* **Training windows are a pure function of ``(seed, epoch, index)``**
  (:func:`window_offset`, a SplitMix64 hash), so a resumed run or a second rank
  recomputes exactly the same batches without saving any sampler state. The
  epoch comes from ``trainer.current_epoch`` when ``train_dataloader()`` is
  built: windows differ between epochs only when the Trainer rebuilds the
  loader (``reload_dataloaders_every_n_epochs=1``); otherwise every epoch sees
  the same windows.
* **Validation is fixed**: non-overlapping windows from the start of the
  validation stream, at most ``val_samples`` of them, so validation losses of
  different runs compare directly.

The default corpus is the Python standard library's own source, which every
machine with Python has (nothing to download): ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` in sorted relative-path order, skipping
``site-packages``, test directories and files that are not valid UTF-8, read
until ``max_chars`` characters. It is deterministic for one Python version;
another Python version has other files and gives another corpus.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "VOCAB_SIZE",
    "CharTextDataModule",
    "RandomWindowDataset",
    "SequentialWindowDataset",
    "decode",
    "encode",
    "load_stdlib_corpus",
    "window_offset",
]

VOCAB_SIZE = 256
"""Number of distinct tokens: one per byte value."""

# Directories of the stdlib tree that are not the library itself: installed
# third-party packages, and test suites (full of deliberately odd code and data).
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

_MASK64 = (1 << 64) - 1


def encode(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``uint8`` tensor (uint8 keeps a 2 MB corpus at 2 MB)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def decode(tokens: Tensor) -> str:
    """Text of a 1-D tensor of byte tokens; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_stdlib_corpus(max_chars: int | None = 2_000_000) -> tuple[str, list[Path]]:
    """Concatenate the standard library's ``*.py`` sources, in sorted relative-path order.

    Files are joined with one newline and the text is cut at exactly ``max_chars``
    characters (``None``: no cap), so the corpus depends only on the Python version.

    Returns:
        The text, and the files it was read from (the last one possibly in part).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into skipped trees.
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())

    parts: list[str] = []
    used: list[Path] = []
    total = 0
    for path in paths:
        if max_chars is not None and total >= max_chars:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files carry other encodings on purpose; skip, never guess
        parts.append(text)
        used.append(path)
        total += len(text) + 1
    corpus = "\n".join(parts)
    if max_chars is not None:
        corpus = corpus[:max_chars]
    return corpus, used


def window_offset(seed: int, epoch: int, index: int, num_offsets: int) -> int:
    """Start of training window ``index`` in ``epoch``: uniform over ``[0, num_offsets)``.

    A SplitMix64 finalizer (Steele, Lea and Flood 2014) over the three integers.
    It is plain integer arithmetic, so unlike a torch generator it cannot change
    between library versions, and it costs nothing to call per item; the modulo
    bias is below ``num_offsets / 2**64``.
    """
    if num_offsets < 1:
        raise ValueError(f"num_offsets must be >= 1, got {num_offsets}")
    x = 0
    for value in (seed, epoch, index):
        x = (x + (value & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x % num_offsets


class RandomWindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """``num_samples`` training windows at hashed offsets; item ``i`` is the same on every call.

    Args:
        tokens: 1-D tensor of byte tokens (any integer dtype).
        block_size: Window length ``T``; each item reads ``T + 1`` tokens.
        num_samples: Length of the dataset (windows per epoch).
        seed: Seed of :func:`window_offset`.
        epoch: Epoch of :func:`window_offset`; a new epoch gives new windows.
    """

    def __init__(self, tokens: Tensor, block_size: int, num_samples: int, seed: int = 0, epoch: int = 0) -> None:
        if tokens.ndim != 1 or tokens.numel() < block_size + 1:
            raise ValueError(f"tokens must be 1-D with at least block_size + 1 = {block_size + 1} elements")
        self.tokens = tokens
        self.block_size = block_size
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def offset(self, index: int) -> int:
        """Start of window ``index`` in the token stream."""
        return window_offset(self.seed, self.epoch, index, self.tokens.numel() - self.block_size)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        start = self.offset(index)
        chunk = self.tokens[start : start + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]


class SequentialWindowDataset(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows at offsets ``0, T, 2T, ...``, at most ``max_samples`` of them.

    Args:
        tokens: 1-D tensor of byte tokens (any integer dtype).
        block_size: Window length ``T``; window ``k`` reads tokens ``kT .. kT + T``.
        max_samples: Cap on the number of windows.
    """

    def __init__(self, tokens: Tensor, block_size: int, max_samples: int) -> None:
        if tokens.ndim != 1 or tokens.numel() < block_size + 1:
            raise ValueError(f"tokens must be 1-D with at least block_size + 1 = {block_size + 1} elements")
        self.tokens = tokens
        self.block_size = block_size
        # The target of the last window needs one token past it.
        self.num_samples = min(max_samples, (tokens.numel() - 1) // block_size)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a block size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class CharTextDataModule(L.LightningDataModule):
    """Byte-level next-token windows over the stdlib source (default) or any UTF-8 text file.

    Batches are ``(input, target)`` pairs of ``LongTensor`` of shape
    ``(batch_size, block_size)``, ``target[:, t] == input[:, t + 1]`` for ``t < T - 1``.
    See the module docstring for the split and the window rules.

    Args:
        text_path: UTF-8 text file to train on; ``None`` uses the standard library's source.
        block_size: Tokens per window (the model's context length).
        batch_size: Windows per batch, for both loaders.
        val_fraction: Share of the token stream, taken from its end, held out for validation.
        max_chars: Characters of text read at most (``None``: all of it). Bounds memory and
            ``setup()`` time; the token count can exceed it by the extra bytes of non-ASCII text.
        train_samples_per_epoch: Training windows per epoch (the train dataset's length).
        val_samples: Validation windows at most.
        num_workers: DataLoader worker processes; 0 loads in the main process, which is
            fastest here since a window is one slice of a tensor.
        seed: Seed of the training window offsets.

    Attributes:
        vocab_size: 256, one token per byte value.
        corpus_files: Files the corpus was read from (set by ``setup()``).
    """

    vocab_size: int = VOCAB_SIZE

    def __init__(
        self,
        text_path: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        max_chars: int | None = 2_000_000,
        train_samples_per_epoch: int = 20_000,
        val_samples: int = 256,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if text_path is not None and not Path(text_path).is_file():
            raise ValueError(f"text_path must name an existing file, got {text_path!r}")
        _check_int("block_size", block_size, 1)
        _check_int("batch_size", batch_size, 1)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
        if max_chars is not None:
            _check_int("max_chars", max_chars, 1)
        _check_int("train_samples_per_epoch", train_samples_per_epoch, 1)
        _check_int("val_samples", val_samples, 1)
        _check_int("num_workers", num_workers, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.save_hyperparameters()
        self.text_path = text_path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.max_chars = max_chars
        self.train_samples_per_epoch = train_samples_per_epoch
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.seed = seed
        self.corpus_files: list[Path] = []
        self._train_tokens: Tensor | None = None
        self._val_tokens: Tensor | None = None

    def _read_text(self) -> str:
        if self.text_path is None:
            text, self.corpus_files = load_stdlib_corpus(self.max_chars)
            return text
        path = Path(self.text_path)
        try:
            with path.open(encoding="utf-8") as f:
                # read(n) counts characters in text mode: the cap never cuts a character.
                text = f.read() if self.max_chars is None else f.read(self.max_chars)
        except UnicodeDecodeError as err:
            raise ValueError(f"text_path {self.text_path!r} is not valid UTF-8 text: {err}") from err
        self.corpus_files = [path]
        return text

    def setup(self, stage: str | None = None) -> None:
        """Read, encode and split the corpus; later calls (any stage) do nothing."""
        if self._train_tokens is not None:
            return
        tokens = encode(self._read_text())
        n = tokens.numel()
        n_val = int(n * self.val_fraction)
        n_train = n - n_val
        need = self.block_size + 1
        if n_train < need or n_val < need:
            source = self.text_path or "the standard library corpus"
            raise ValueError(
                f"corpus too small: {source} gives {n} tokens, split into {n_train} train and {n_val} "
                f"validation (val_fraction={self.val_fraction}), but each split needs at least "
                f"block_size + 1 = {need}; use a longer text, a larger max_chars or a smaller block_size"
            )
        self._train_tokens = tokens[:n_train]
        self._val_tokens = tokens[n_train:]

    def _require_setup(self) -> tuple[Tensor, Tensor]:
        if self._train_tokens is None or self._val_tokens is None:
            raise RuntimeError("call setup() before asking CharTextDataModule for data")
        return self._train_tokens, self._val_tokens

    @property
    def train_tokens(self) -> Tensor:
        """The training part of the token stream (``uint8``)."""
        return self._require_setup()[0]

    @property
    def val_tokens(self) -> Tensor:
        """The validation part of the token stream (``uint8``), which follows the training part."""
        return self._require_setup()[1]

    def train_dataset(self, epoch: int = 0) -> RandomWindowDataset:
        """Training windows of ``epoch``."""
        return RandomWindowDataset(self.train_tokens, self.block_size, self.train_samples_per_epoch, self.seed, epoch)

    def val_dataset(self) -> SequentialWindowDataset:
        """The fixed validation windows."""
        return SequentialWindowDataset(self.val_tokens, self.block_size, self.val_samples)

    def _loader(self, dataset: Dataset[tuple[Tensor, Tensor]], drop_last: bool) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=False,  # offsets are already hashed; order must stay a function of the index
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Training loader; full batches only, so every step sees ``batch_size`` windows."""
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return self._loader(self.train_dataset(epoch), drop_last=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Validation loader over the fixed windows; the last batch may be short."""
        return self._loader(self.val_dataset(), drop_last=False)
