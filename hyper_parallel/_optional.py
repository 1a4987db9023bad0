"""Optional dependencies: every import of one goes through :func:`require`, which names the
``pip install`` extra that provides it when it is missing."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# The extra of pyproject.toml's optional-dependencies that installs each optional package.
EXTRAS = {"tokenizers": "recipes", "pyarrow": "recipes", "tqdm": "recipes", "matplotlib": "recipes",
          "tensorboard": "tensorboard", "wandb": "wandb", "torchao": "float8", "fsspec": "s3",
          "transformers": "hf"}


class MissingDependency(ImportError):
    """An optional package is not installed; the message says which extra installs it."""


def install_hint(package: str, purpose: str) -> str:
    """``"<purpose> needs the '<package>' package: pip install 'hyper_parallel[<extra>]'"``."""
    return f"{purpose} needs the {package!r} package: pip install 'hyper_parallel[{EXTRAS[package]}]'"


def available(package: str) -> bool:
    """Whether the optional ``package`` can be imported (without importing it)."""
    return importlib.util.find_spec(package) is not None


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (e.g. ``pyarrow.parquet``) of an optional package listed in ``EXTRAS``.

    Raises:
        MissingDependency: the package is not installed (the message names the extra).
    """
    package = module.split(".")[0]
    if package not in EXTRAS:
        raise KeyError(f"{package!r} is not a declared optional dependency ({sorted(EXTRAS)})")
    try:
        importlib.import_module(package)  # first: a submodule imported earlier would hide its absence
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != package:
            raise  # the package is there but one of its own dependencies is not
        raise MissingDependency(install_hint(package, purpose)) from None
