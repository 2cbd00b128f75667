"""Device and dtype names as users type them, for every command and library entry point.

One table of dtype spellings (``bf16`` is ``bfloat16``, ``fp32`` is ``float32``, ...) and one
pattern of device names (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``), so that train, eval
and inspect accept the same words. ``resolve_device`` imports torch; the rest does not.
"""

from __future__ import annotations

import re

from merit_core.errors import ConfigError

DTYPE_ALIASES: dict[str, str] = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


def canonical_dtype(name: str | None) -> str | None:
    """'bf16' -> 'bfloat16', 'FP32' -> 'float32', ...; None for a name that is no dtype."""
    if name is None:
        return None
    return DTYPE_ALIASES.get(name.strip().lower())


def check_device(device: str, what: str = "--device") -> str:
    """The device name, lower-cased, if it is auto, cpu, cuda, cuda:N or mps; else a ConfigError."""
    value = device.strip().lower()
    if not DEVICE_PATTERN.fullmatch(value):
        raise ConfigError(f"{what} {device}: use auto, cpu, cuda or cuda:N")
    return value


def resolve_device(device: str | None, what: str = "--device") -> str:
    """'auto'/None -> 'cuda' when a GPU is visible, else 'cpu'; check an explicit CUDA device exists."""
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{what} {device}: not a torch device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what} {device}: no CUDA GPU is visible; use {what} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{what} {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return str(dev)
