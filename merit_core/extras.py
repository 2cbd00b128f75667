"""Optional dependencies: which pip extra brings which package, and one-line errors when one is missing.

`pip install merit-optim` is the optimizer and its registry (torch alone). Everything else is
optional: ``[baselines]`` (pytorch-optimizer: LAMB, Lion), ``[cli]`` (the whole `merit` tool),
and the experiment trackers (tensorboard, wandb, mlflow), each installed on its own.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from merit_core.errors import MissingDependencyError

# import name -> (what to pip install, the package's own name when it differs from the import name)
CLI_MODULES: dict[str, str] = {
    "click": "click",
    "rich": "rich",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "transformers": "transformers",
    "huggingface_hub": "huggingface-hub",
    "accelerate": "accelerate",
    "tokenizers": "tokenizers",
    "datasets": "datasets",
    "pyarrow": "pyarrow",
    "lm_eval": "lm-eval",
    "matplotlib": "matplotlib",
    "yaml": "pyyaml",
    "pytorch_optimizer": "pytorch-optimizer",
    "tomli_w": "tomli-w",
}


def is_installed(module: str) -> bool:
    """Whether `module` (a top-level import name) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_cli_modules() -> list[str]:
    """The distributions of the ``[cli]`` extra that are not installed (empty when the tool is complete)."""
    return [package for module, package in CLI_MODULES.items() if not is_installed(module)]


def cli_install_hint(missing: list[str]) -> str:
    """The one line `merit` prints when its extra is missing."""
    return (
        f"the merit command needs the [cli] extra ({', '.join(missing)} not installed): pip install 'merit-optim[cli]'"
    )


def require(module: str, feature: str, install: str | None = None) -> ModuleType:
    """Import `module` for `feature`, or raise MissingDependencyError naming what to pip install."""
    if not is_installed(module):
        raise MissingDependencyError(f"{feature} needs the {module} package: pip install {install or module}")
    return importlib.import_module(module)
