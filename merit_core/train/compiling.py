"""torch.compile for training: when it is on, what is compiled, and what a failure says.

`compile` in the run config: 'auto' (on for CUDA, off for CPU, where inductor's C++ compile of a
model costs minutes and pays back little), true or false to force.

Regional compilation: each transformer block's `forward` is compiled in place (the blocks are
the same code, so after the first the rest reuse its graph and the cold start stays short),
not the whole model. Parameter names, state dicts, weight tying and saving are untouched; wrapper
hooks (DDP's gradient buckets, FSDP2's all-gathers around each block) stay outside the compiled
region and work as without compilation. The output layer's chunked loss compiles its own chunk
step (merit_core.train.lm_loss). Evaluation and the attention-logit probe run the blocks eagerly
(`eager()`): the probe swaps the attention function, and evaluation would otherwise compile a
second, no-grad graph for a few batches.

A compilation failure is never silent. Under `compile = true` (the user asked for it)
`compile_errors()` turns it into one CompileFailed line naming `--set compile=false`. Under
`compile = auto` ("on where it works") the run warns once with the compiler's first error line
(`fallback_warning`), redoes the step eagerly and stays eager (`eager()`), and its summary says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from merit_core.errors import CompileFailed

_F = TypeVar("_F", bound=Callable[..., Any])


class ContextAndDecorator(Protocol):
    """What ``torch.compiler.set_stance`` returns: a context manager that also decorates a function."""

    def __enter__(self) -> object: ...

    def __exit__(self, *exc_info: object) -> bool | None: ...

    def __call__(self, fn: _F) -> _F: ...


COMPILE_SETTINGS = ("auto", True, False)


def resolve_compile(setting: str | bool, device: torch.device) -> bool:
    """What a run's `compile` setting means on `device`."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def compile_note(blocks: int, seconds: float) -> str:
    """The line a run shows after its first compiled step."""
    return (
        f"compiled {blocks} transformer blocks (compile=true/auto): the first step took {seconds:.1f} s "
        "with compilation; set compile=false to skip it"
    )


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers of a transformers model (its `_no_split_modules` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:  # fall back to the longest ModuleList (GPT-2's `h`, Llama's `layers`)
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        longest: torch.nn.ModuleList | None = max(lists, key=len) if lists else None
        blocks = list(longest) if longest is not None else []
    return blocks


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each transformer block's forward in place; return how many were compiled."""
    blocks = transformer_blocks(model)
    for block in blocks:
        if not getattr(block.forward, "_merit_compiled", False):
            compiled = torch.compile(block.forward)
            compiled._merit_compiled = True  # type: ignore[attr-defined]  # a marker on the function
            block.forward = compiled
    return len(blocks)


def eager() -> ContextAndDecorator:
    """Within it, compiled code runs eagerly (no compilation, no recompilation)."""
    return torch.compiler.set_stance("force_eager")


def _is_compile_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor")) or type(exc).__name__ in (
        "BackendCompilerFailed",
        "InductorError",
        "CppCompileError",
    )


def compile_failure(exc: BaseException) -> str | None:
    """'<type>: <first line>' of the compiler's own error under dynamo's wrappers, or None when
    `exc` is not a torch.compile failure."""
    if not _is_compile_error(exc):
        return None
    root = exc
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None and inner is not root:
        root = inner
    first = (str(root).strip().splitlines() or [""])[0][:200]
    return f"{type(root).__name__}: {first}"


def fallback_warning(failure: str) -> str:
    """The one line a `compile = auto` run shows when it falls back to eager."""
    return f"torch.compile failed ({failure}); running eager; --set compile=false to skip this"


@contextlib.contextmanager
def compile_errors(active: bool) -> Iterator[None]:
    """Turn a torch.compile failure inside the block into CompileFailed (when `active`)."""
    try:
        yield
    except Exception as exc:
        failure = compile_failure(exc) if active else None
        if failure is None:
            raise
        raise CompileFailed(f"torch.compile failed ({failure}); run with --set compile=false") from None
