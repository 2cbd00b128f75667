"""Whether the Hugging Face hub can be reached, decided once and quickly.

Offline, transformers / datasets / lm-eval retry for tens of seconds before failing. Calling
`prefer_offline()` before they are imported sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE when the
hub does not answer within a few seconds, so that a missing model, tokenizer or dataset fails at once.
"""

from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request

_TRUE = {"1", "true", "yes", "on"}


def offline_by_env() -> bool:
    """True when the user (or an earlier call) already declared the hub offline."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the hub endpoint answers an HTTP request within `timeout` seconds."""
    if offline_by_env():
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint + "/api/health", method="HEAD"), timeout=timeout)
        return True
    except urllib.error.HTTPError:
        return True  # the server answered, even if not with 200
    except (OSError, ValueError):
        return False


def prefer_offline(timeout: float = 3.0) -> bool:
    """Switch the HF libraries to offline mode when the hub is unreachable; return True if offline.

    Must run before `transformers`, `datasets`, `huggingface_hub` or `lm_eval` are imported,
    since they read these variables at import time.
    """
    if hub_reachable(timeout):
        return False
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    return True


def looks_like_hub_id(name: str) -> bool:
    """True for strings shaped like a hub repo id ('gpt2', 'org/name') that are not local paths."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")) or "\\" in name:
        return False
    parts = name.split("/")
    return len(parts) <= 2 and all(parts) and not name.endswith((".json", ".txt", ".jsonl", ".parquet", ".toml"))
