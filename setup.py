"""What the wheel holds; every other setting is in pyproject.toml.

pyproject.toml cannot both find packages and map a folder outside them onto one, so this
file does both: the library, and apart from it the demo (model, data, the Muon-vs-AdamW
runner), which the library never imports; and the YAML configs of the repository's
``configs/`` installed as ``lightning_muon/configs/``, where ``python -m lightning_muon fit
--config muon`` finds them (``lightning_muon.bundled_configs``). One copy of each config:
a clone reads them in ``configs/``, the wheel inside the package.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["lightning_muon", "lightning_muon.*", "lightning_muon_demo", "lightning_muon_demo.*"]),
        "lightning_muon.configs",
    ],
    package_dir={"lightning_muon.configs": "configs"},
    package_data={"lightning_muon.configs": ["*.yaml"]},
)
