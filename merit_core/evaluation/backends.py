"""How `merit eval` builds lm-eval's model object for one checkpoint: on one device, split over several
(lm-eval's `parallelize=True`), or through vLLM (`--model vllm`).

- One device (the default): merit loads the model itself (safetensors only, merit's dtype) and hands
  the loaded model to lm-eval's HFLM.
- `parallelize=True` (`--model_args parallelize=True,max_memory_per_gpu=40GiB,offload_folder=DIR`): a
  model larger than one device. HFLM loads it from the checked folder through accelerate's device map
  (`device_map="auto"` over the visible GPUs, then host memory, then `offload_folder`), with merit's
  dtype and `use_safetensors=True`; the folder was checked as for one device (no pickle weights, no
  shipped code without --trust-remote-code, checksums) before HFLM sees it.
- `vllm` (`--model vllm --model_args tensor_parallel_size=N,data_parallel_size=M`): lm-eval's VLLM
  model, with `load_format="safetensors"`; refused in one line where vLLM is not installed.

The keys are lm-eval's own, so a user's `--model_args` reads as in lm-eval's documentation.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from merit_core.errors import ConfigError, MissingDependencyError

HF = "hf"
VLLM = "vllm"
HF_NAMES = (HF, "hf-auto", "huggingface")  # lm-eval's names of its HFLM model
# lm-eval HFLM's keys for one model over several devices (accelerate's device map)
SPLIT_KEYS = ("parallelize", "max_memory_per_gpu", "max_cpu_memory", "offload_folder", "device_map")
# lm-eval VLLM's keys for its parallel sizes and memory
VLLM_KEYS = ("tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization", "max_model_len")
_INT_KEYS = ("tensor_parallel_size", "data_parallel_size", "max_model_len")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")

ModelArgs = tuple[tuple[str, str], ...]  # (key, value) as typed in --model_args, in order


def backend_of(model: str) -> str:
    """merit's name of lm-eval's `--model` value: 'hf' or 'vllm'; ConfigError for any other, and
    MissingDependencyError (one line) for vllm where it is not installed."""
    name = model.strip().lower()
    if name in HF_NAMES:
        return HF
    if name == VLLM:
        if importlib.util.find_spec("vllm") is None:
            raise MissingDependencyError(
                "--model vllm: vLLM is not installed here (pip install vllm, on a CUDA machine); "
                "without it merit eval scores with lm-eval's --model hf"
            )
        return VLLM
    raise ConfigError(
        f"--model {model}: merit eval runs Hugging Face causal LMs (lm-eval's --model hf, or --model vllm); "
        "give the checkpoint as the argument: merit eval CKPT --tasks ..."
    )


def keys_of(backend: str) -> tuple[str, ...]:
    """The --model_args keys (beyond pretrained/dtype/device/batch_size) `backend` passes to lm-eval."""
    return VLLM_KEYS if backend == VLLM else SPLIT_KEYS


def check_model_args(backend: str, args: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The keyword arguments `args` give lm-eval's model class, values read as lm-eval reads them
    (True/False, integers); ConfigError for a key `backend` does not take or a value it cannot read."""
    out: dict[str, Any] = {}
    allowed = keys_of(backend)
    for key, value in args:
        if key not in allowed:
            raise ConfigError(f"--model_args {key}: --model {backend} takes {', '.join(allowed)} here, not {key!r}")
        text = value.strip()
        if key == "parallelize":
            if text.lower() not in _TRUE + _FALSE:
                raise ConfigError(f"--model_args parallelize={value}: give True or False")
            out[key] = text.lower() in _TRUE
        elif key in _INT_KEYS:
            if not text.isascii() or not text.isdigit() or int(text) < 1:
                raise ConfigError(f"--model_args {key}={value}: give a positive integer")
            out[key] = int(text)
        elif key == "gpu_memory_utilization":
            try:
                fraction = float(text)
            except ValueError:
                fraction = -1.0
            if not 0 < fraction <= 1:
                raise ConfigError(f"--model_args {key}={value}: give a fraction in (0, 1]")
            out[key] = fraction
        elif not text:
            raise ConfigError(f"--model_args {key}= is empty")
        else:
            out[key] = text
    return out


def splits_model(backend: str, args: Mapping[str, Any]) -> bool:
    """True when lm-eval places the model itself (over several devices): parallelize=True, a device
    map, or vLLM. merit then skips its one-device size check: the model is meant to exceed one device."""
    return backend == VLLM or bool(args.get("parallelize")) or "device_map" in args


def build_split_lm(location: str, tokenizer: Any, args: Mapping[str, Any], **common: Any) -> Any:
    """lm-eval's HFLM loading the checked folder `location` itself, split by accelerate's device map."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=location, tokenizer=tokenizer, use_safetensors=True, **common, **args)


def build_vllm(location: str, args: Mapping[str, Any], dtype: str, batch_size: int | str, trust: bool) -> Any:
    """lm-eval's VLLM model on the checked folder `location`, reading safetensors weights only."""
    from lm_eval.models.vllm_causallms import VLLM as VLLMModel

    return VLLMModel(
        pretrained=location,
        dtype=dtype,
        batch_size=batch_size,
        trust_remote_code=trust,
        load_format="safetensors",
        **args,
    )
