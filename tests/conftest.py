"""Test-wide environment: offline Hugging Face libraries, quiet logs, caches in a temp folder."""

import os
import tempfile

import pytest

_TMP = tempfile.mkdtemp(prefix="merit-tests-")
# Under pytest-xdist (`-n auto`) each worker is a process with this environment of its own, but the
# workers of one run share merit's cache (the built C++ kernel, the prepared built-in corpus and
# tasks: built under a lock or written by atomic rename), so each is built once per run.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_CACHE = os.path.join(tempfile.gettempdir(), f"merit-tests-{_RUN}") if _RUN else _TMP
for key, value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HOME": os.path.join(_TMP, "hf"),
    "HF_DATASETS_CACHE": os.path.join(_TMP, "hf", "datasets"),
    "MERIT_CACHE_DIR": os.path.join(_CACHE, "merit-cache"),
    "MPLBACKEND": "Agg",
}.items():
    os.environ[key] = value
# Workers share the cores: each gets its part of them for torch's intra-op threads (at least 2, so the
# multi-threaded paths are still run; CI's second pass pins 1 thread itself).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(2, (os.cpu_count() or 1) // _WORKERS))
# Compiled kernels (Inductor / C++ extensions) may reuse a persistent cache across runs.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "merit-inductor-cache"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, request):
    """A small prepared-data folder (tokens + tokenizer), one per test module; a module's
    ``DATA_SENTENCES`` sets its corpus size (default 3000 sentences)."""
    from tests.prepared_data import write_prepared

    n_sentences = getattr(request.module, "DATA_SENTENCES", 3000)
    return write_prepared(tmp_path_factory.mktemp("data"), n_sentences=n_sentences)


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory):
    """A tiny GPT-2 config.json, one per test module."""
    from tests.prepared_data import write_tiny_model_config

    return write_tiny_model_config(tmp_path_factory.mktemp("model"))


@pytest.fixture
def no_hang():
    """Fail a case that blocks (a FIFO opened for reading waits for a writer forever) instead of hanging."""
    import signal

    def stuck(signum, frame):
        raise TimeoutError("blocked for 120 s (a FIFO read?)")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# The test files that take longest (measured with --durations; CONTRIBUTING.md lists the slowest
# tests). Under pytest-xdist with --dist loadfile they are handed out first, so that the last files
# the workers take are short ones and the workers finish together; a serial run keeps its order.
LONGEST_FIRST = (
    "tests/compare/test_compare.py",
    "tests/cli/test_readme.py",
    "tests/train/test_train.py",
    "tests/train/test_kernels.py",
    "tests/train/test_fsdp.py",
    "tests/train/test_train_optimizers.py",
    "tests/integrations/test_callbacks.py",
    "tests/cli/test_golden.py",
    "tests/diagnostics/test_instability_inspect.py",
    "tests/eval/test_builtin_tasks.py",
    "tests/diagnostics/test_hessian.py",
    "tests/optim/test_merit_triton.py",
    "tests/optim/test_merit_compile.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
