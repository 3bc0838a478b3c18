"""``python -m lightning_muon fit --config muon`` (a bundled config by name, or any file)."""

from lightning_muon.cli import main

if __name__ == "__main__":
    main()
