"""``python -m lightning_muon fit --config configs/muon.yaml``."""

from lightning_muon.cli import main

if __name__ == "__main__":
    main()
