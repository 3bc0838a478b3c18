"""CharTextDataModule: corpus, deterministic split, window shapes, argument checks."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_muon_demo.data import (
    CharTextDataModule,
    RandomWindowDataset,
    SequentialWindowDataset,
    decode,
    encode,
    load_stdlib_corpus,
    window_offset,
)

# A small stdlib slice keeps each setup() well under a second.
SMALL = 60_000


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox, café\n" for i in range(400)), encoding="utf-8")
    return path


def _dm(**kwargs) -> CharTextDataModule:
    kwargs.setdefault("max_chars", SMALL)
    kwargs.setdefault("block_size", 32)
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("train_samples_per_epoch", 64)
    kwargs.setdefault("val_samples", 16)
    dm = CharTextDataModule(**kwargs)
    dm.setup("fit")
    return dm


def test_encode_decode_roundtrip_bytes():
    tokens = encode("héllo\n")
    assert tokens.dtype == torch.uint8
    assert tokens.tolist() == list("héllo\n".encode())
    assert decode(tokens) == "héllo\n"
    assert CharTextDataModule.vocab_size == 256


def test_default_corpus_comes_from_the_stdlib():
    text, files = load_stdlib_corpus(SMALL)
    assert len(text) == SMALL
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert files, "no stdlib files read"
    for f in files:
        rel = f.relative_to(stdlib)
        assert f.suffix == ".py"
        assert not {"site-packages", "test", "tests"} & set(rel.parts)
    rels = [f.relative_to(stdlib).as_posix() for f in files]
    assert rels == sorted(rels)
    assert text.startswith(files[0].read_text(encoding="utf-8")[:1000])

    dm = _dm()
    assert dm.corpus_files == files
    assert dm.train_tokens.numel() + dm.val_tokens.numel() >= SMALL


def test_two_instances_give_identical_data_and_setup_is_idempotent():
    a, b = _dm(seed=3), _dm(seed=3)
    assert torch.equal(a.train_tokens, b.train_tokens)
    assert torch.equal(a.val_tokens, b.val_tokens)
    for la, lb in ((a.train_dataloader(), b.train_dataloader()), (a.val_dataloader(), b.val_dataloader())):
        for (xa, ya), (xb, yb) in zip(la, lb):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    before = a.train_tokens
    a.setup("validate")
    assert a.train_tokens is before


def test_seed_and_epoch_change_the_training_windows():
    dm = _dm(seed=0)
    offsets = [dm.train_dataset(0).offset(i) for i in range(64)]
    assert offsets == [dm.train_dataset(0).offset(i) for i in range(64)]
    assert offsets != [dm.train_dataset(1).offset(i) for i in range(64)]
    assert offsets != [_dm(seed=1).train_dataset(0).offset(i) for i in range(64)]
    assert len(set(offsets)) > 50


def test_train_dataloader_takes_the_trainers_epoch():
    # With reload_dataloaders_every_n_epochs=1 the Trainer rebuilds the loader each
    # epoch (and after a resume), so the windows follow trainer.current_epoch.
    dm = _dm()
    dm.trainer = SimpleNamespace(current_epoch=2)  # type: ignore[assignment]
    assert dm.train_dataloader().dataset.epoch == 2
    x, _ = next(iter(dm.train_dataloader()))
    assert torch.equal(x[0], dm.train_dataset(2)[0][0])


def test_window_offset_is_a_pure_function_in_range():
    values = [window_offset(7, 2, i, 1000) for i in range(2000)]
    assert values == [window_offset(7, 2, i, 1000) for i in range(2000)]
    assert min(values) >= 0 and max(values) < 1000
    assert len(set(values)) > 800  # close to uniform: ~865 distinct expected
    assert window_offset(-1, 0, 0, 10) in range(10)
    with pytest.raises(ValueError, match="num_offsets"):
        window_offset(0, 0, 0, 0)


def test_split_is_the_tail_and_windows_stay_on_their_side():
    dm = _dm(val_fraction=0.25)
    n_train, n_val = dm.train_tokens.numel(), dm.val_tokens.numel()
    total = n_train + n_val
    assert n_val == int(total * 0.25)
    full = encode(load_stdlib_corpus(SMALL)[0])
    assert torch.equal(torch.cat([dm.train_tokens, dm.val_tokens]), full)

    train = dm.train_dataset()
    for i in range(len(train)):
        # The window and its shifted target read tokens [o, o + T], all before n_train.
        assert train.offset(i) + dm.block_size + 1 <= n_train
    val = dm.val_dataset()
    assert len(val) == 16
    x, y = val[0]
    assert torch.equal(x, full[n_train : n_train + dm.block_size].long())


def test_batches_shapes_dtypes_and_shift(text_file: Path):
    dm = _dm(text_path=str(text_file), block_size=16, batch_size=5, train_samples_per_epoch=23, val_samples=7)
    train = list(dm.train_dataloader())
    assert len(train) == 4  # 23 // 5, the short last batch dropped
    for x, y in train:
        assert x.shape == y.shape == (5, 16)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and int(x.max()) < 256
    val = list(dm.val_dataloader())
    assert [v[0].shape[0] for v in val] == [5, 2]
    for x, y in val:
        assert torch.equal(x[:, 1:], y[:, :-1])
    # Each target is the token after its input in the stream.
    ds = dm.train_dataset()
    x, y = ds[3]
    o = ds.offset(3)
    assert torch.equal(y, dm.train_tokens[o + 1 : o + 17].long())


def test_custom_text_file_is_the_corpus(text_file: Path):
    dm = _dm(text_path=str(text_file), max_chars=None)
    assert dm.corpus_files == [text_file]
    full = encode(text_file.read_text(encoding="utf-8"))
    assert torch.equal(torch.cat([dm.train_tokens, dm.val_tokens]), full)
    capped = _dm(text_path=str(text_file), max_chars=1000)
    assert decode(torch.cat([capped.train_tokens, capped.val_tokens])) == text_file.read_text()[:1000]


def test_corpus_smaller_than_a_window_raises(tmp_path: Path):
    path = tmp_path / "tiny.txt"
    path.write_text("x" * 40)
    with pytest.raises(ValueError, match="corpus too small.*block_size"):
        _dm(text_path=str(path), block_size=32)


def test_non_utf8_file_raises(tmp_path: Path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9 " * 100)
    with pytest.raises(ValueError, match="text_path.*UTF-8"):
        _dm(text_path=str(path))


def test_data_before_setup_raises():
    dm = CharTextDataModule(max_chars=SMALL)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"text_path": "/no/such/file.txt"}, "text_path"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": "0.1"}, "val_fraction"),
        ({"max_chars": 0}, "max_chars"),
        ({"train_samples_per_epoch": 0}, "train_samples_per_epoch"),
        ({"val_samples": 0}, "val_samples"),
        ({"num_workers": -1}, "num_workers"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CharTextDataModule(**kwargs)


def test_datasets_reject_short_streams_and_bad_indices():
    tokens = torch.arange(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block_size"):
        RandomWindowDataset(tokens, block_size=10, num_samples=1)
    with pytest.raises(ValueError, match="block_size"):
        SequentialWindowDataset(tokens, block_size=10, max_samples=1)
    ds = SequentialWindowDataset(tokens, block_size=3, max_samples=100)
    assert len(ds) == 3  # windows at 0, 3, 6; the one at 9 has no target
    with pytest.raises(IndexError):
        ds[3]
