"""The readers of bytes someone else wrote, fuzzed: whatever the bytes, merit's own error or a result.

Each reader gets files made by hypothesis (a fixed seed, a bounded number of examples, a few
seconds each): a safetensors header, a config.json, a TOML train config, the marks and meta.json
of a prepared folder. Any exception that is not a MeritError (the one-line errors the CLI prints)
fails: a TypeError, KeyError or MemoryError there would reach a user as a traceback.
"""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from merit_core.checkpoint.safe import validate_safetensors
from merit_core.compare.runner import STATUS_FILE, read_status
from merit_core.data.meta import PREPARED_MARKER, is_merit_prepared, load_meta
from merit_core.data.prepare import remove_stale_temp
from merit_core.data.publish import check_target
from merit_core.diagnostics.layout import detect_layout, read_config
from merit_core.durable_writes import STAGING_MARKER
from merit_core.errors import MeritError
from merit_core.metrics import METRICS_FILE, read_metrics
from merit_core.models import model_config
from merit_core.models.limits import check_model_config
from merit_core.train.config import FIELD_NAMES, TrainConfig, load_config

# The readers are imported above, once: the examples' seconds are the fuzzing's, not torch's import.

FUZZ = settings(
    max_examples=120,
    derandomize=True,  # the same examples on every run: a failure reproduces, CI never flakes
    deadline=None,  # a slow first example (an import) is not a failure
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="merit-fuzz-") as folder:
        yield Path(folder)


# Values of every JSON / TOML kind, the odd ones over-represented: text for numbers, huge and
# negative numbers, NaN, nested tables.
SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, -1, 2**31, 2**63, 2**64 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["2", "²", "١٢", "auto", "", "gpt2", "llama", "\x1b[2J", "[/bold]"]),
    st.booleans(),
    st.none(),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _allowed(call, *args: Any) -> Any:
    """`call(*args)`; a MeritError is an accepted answer (returned), anything else fails the test."""
    try:
        return call(*args)
    except MeritError as exc:
        return exc


# -- safetensors headers ----------------------------------------------------------------------
DTYPES = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "Q7", "", "f32"])
SHAPES = st.one_of(st.lists(st.integers(min_value=-3, max_value=2**40), max_size=4), VALUES)
OFFSETS = st.one_of(st.lists(st.integers(min_value=-8, max_value=2**66), min_size=0, max_size=3), VALUES)
ENTRY = st.one_of(st.fixed_dictionaries({"dtype": DTYPES, "shape": SHAPES, "data_offsets": OFFSETS}), VALUES)
HEADERS = st.dictionaries(st.one_of(st.text(max_size=10), st.just("__metadata__")), ENTRY, max_size=4)


@st.composite
def safetensors_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["json", "raw", "length"]))
    body = json.dumps(draw(HEADERS)).encode() if kind != "raw" else draw(st.binary(max_size=64))
    if kind == "length":
        length = draw(st.one_of(st.integers(min_value=0, max_value=2**64 - 1), st.just(len(body) + 1)))
    else:
        length = len(body)
    return struct.pack("<Q", length) + body + draw(st.binary(max_size=48))


@FUZZ
@given(data=st.one_of(safetensors_bytes(), st.binary(max_size=40)))
def test_safetensors_headers(scratch, data):
    path = scratch / "model.safetensors"
    path.write_bytes(data)
    result = _allowed(validate_safetensors, path)
    assert isinstance(result, (dict, MeritError))


# -- config.json --------------------------------------------------------------------------------
CONFIG_KEYS = st.sampled_from(
    [
        "model_type",
        "n_head",
        "n_layer",
        "n_embd",
        "n_positions",
        "n_inner",
        "vocab_size",
        "num_attention_heads",
        "num_hidden_layers",
        "hidden_size",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rope_scaling",
        "rope_theta",
        "activation_function",
        "hidden_act",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "auto_map",
    ]
)


class _Shapes(dict):
    """Tensor names -> shapes, read by detect_layout like a safetensors reader's `shape(name)`."""

    def shape(self, name: str) -> tuple[int, ...]:
        return self[name]


# The tensors of a 2-layer GPT-2 of width 32 (what BASE describes), as shapes only.
GPT2_SHAPES = _Shapes(
    {"transformer.wte.weight": (320, 32), "transformer.wpe.weight": (64, 32)}
    | {f"transformer.h.{i}.attn.c_attn.weight": (32, 96) for i in range(2)}
    | {f"transformer.h.{i}.attn.c_proj.weight": (32, 32) for i in range(2)}
)
BASE = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "vocab_size": 320}


@st.composite
def config_bytes(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=64))
    changes = draw(st.dictionaries(CONFIG_KEYS, VALUES, max_size=4))
    if draw(st.booleans()):
        changes["model_type"] = draw(st.sampled_from(["gpt2", "llama"]))
    return json.dumps({**BASE, **changes}).encode()


@FUZZ
@given(data=config_bytes())
def test_config_json_readers(scratch, data):
    path = scratch / "config.json"
    path.write_bytes(data)
    raw = _allowed(read_config, path)  # inspect's reader
    assert isinstance(raw, (dict, MeritError))
    if isinstance(raw, dict):  # and what inspect does with it: the layout checked against weights
        _allowed(detect_layout, GPT2_SHAPES, raw)
    config = _allowed(model_config, str(path), 320)  # train's and eval's
    if not isinstance(config, MeritError):
        _allowed(check_model_config, config, str(path))


# -- TOML train configs ---------------------------------------------------------------------------
def _field_names() -> list[str]:
    return sorted(FIELD_NAMES)


@st.composite
def toml_bytes(draw) -> bytes:
    import tomli_w

    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        return draw(st.text(max_size=60)).encode("utf-8", "surrogatepass")
    keys = st.one_of(st.sampled_from(_field_names()), st.text(max_size=8))
    table = draw(st.dictionaries(keys, VALUES, max_size=5))
    try:
        return tomli_w.dumps(table).encode()
    except (TypeError, ValueError):  # None or NaN-free rules of TOML: write what can be written
        return json.dumps(table, default=str).encode()


@FUZZ
@given(data=toml_bytes())
def test_toml_train_configs(scratch, data):
    path = scratch / "train.toml"
    path.write_bytes(data)
    result = _allowed(load_config, path)
    assert isinstance(result, (TrainConfig, MeritError))


# -- prepared folders: the mark, meta.json, a staging marker ----------------------------------------
MARKERS = st.one_of(
    st.binary(max_size=80),
    VALUES.map(lambda v: json.dumps(v, default=str).encode()),
    st.sampled_from([b'{"format": "merit-tokens-v1"}', b'{"format": 5}', b"\xff\xfe", b"[]"]),
)
META = st.one_of(
    st.binary(max_size=80),
    st.dictionaries(
        st.sampled_from(
            [
                "format",
                "dtype",
                "vocab_size",
                "eos_token_id",
                "train_tokens",
                "val_tokens",
                "tokenizer",
                "source",
                "documents",
            ]
        ),
        VALUES,
        max_size=9,
    ).map(lambda v: json.dumps({"format": "merit-tokens-v1", "dtype": "uint16", **v}, default=str).encode()),
)
PIDS = st.one_of(st.text(max_size=8), st.sampled_from(["1", "²", "١٢", "99999999999999999999", "-3", ""]))


@FUZZ
@given(marker=MARKERS, meta=META, pid=PIDS, staging=st.binary(max_size=40))
def test_prepared_folder_marks(scratch, marker, meta, pid, staging):
    root = scratch / "prepared"
    target = root / "out"
    target.mkdir(parents=True, exist_ok=True)
    (target / PREPARED_MARKER).write_bytes(marker)
    (target / "meta.json").write_bytes(meta)
    side = root / f".merit-tmp-out-{pid.replace('/', '_')}"
    try:
        side.mkdir(exist_ok=True)
        (side / STAGING_MARKER).write_bytes(staging)
    except (OSError, ValueError):  # a name the file system refuses (NUL, too long): nothing to read
        pass
    assert isinstance(is_merit_prepared(target), bool)  # never an exception: False for anything odd
    assert isinstance(_allowed(load_meta, target), object)
    _allowed(check_target, target)
    _allowed(remove_stale_temp, target)
    assert (target / PREPARED_MARKER).read_bytes() == marker  # a reader never changes what it reads


# -- compare's run markers and the metrics.jsonl it reads -----------------------------------------
STATUS = st.one_of(
    st.binary(max_size=40),
    st.just(b"[" * 5000),
    st.fixed_dictionaries(
        {},
        optional={
            "state": st.one_of(st.sampled_from(["diverged", "finished", "missing", ""]), VALUES),
            "message": st.one_of(st.text(max_size=12), VALUES),
            "config": st.one_of(st.dictionaries(st.text(max_size=6), VALUES, max_size=3), VALUES),
        },
    ).map(lambda v: json.dumps(v).encode()),
    VALUES.map(lambda v: json.dumps(v).encode()),
)
METRICS_LINE = st.one_of(
    st.fixed_dictionaries({"step": VALUES}, optional={"loss": VALUES, "val_loss": VALUES, "max_logit": VALUES}),
    VALUES,
).map(lambda v: json.dumps(v))
METRICS = st.one_of(
    st.lists(st.one_of(METRICS_LINE, st.text(max_size=12), st.just("[" * 5000)), max_size=5).map(
        lambda lines: "\n".join(lines).encode("utf-8", "surrogatepass")
    ),
    st.binary(max_size=60),
)


@FUZZ
@given(status=STATUS, metrics=METRICS)
def test_compare_run_markers_and_metrics(scratch, status, metrics):
    """read_status answers a dict or a MeritError; read_metrics a list of records, or the ValueError
    its callers turn into a "missing" run (a line that is not a record, bytes that are not UTF-8)."""
    run = scratch / "compare-run"
    run.mkdir(exist_ok=True)
    (run / STATUS_FILE).write_bytes(status)
    (run / METRICS_FILE).write_bytes(metrics)
    found = _allowed(read_status, run)
    if isinstance(found, dict):
        assert found["state"] == "diverged" and isinstance(found["message"], (str, type(None)))
        assert isinstance(found["config"], (dict, type(None)))
    try:
        records = read_metrics(run)
    except ValueError:
        return
    assert all(isinstance(r, dict) and isinstance(r.get("step", 0), int) for r in records)
