"""TrainerState and its checksums, the step selection, and the readers of trainer and optimizer state:
typed fields refused in one line, a flipped byte in any checkpoint file refused, and fuzzing in
which nothing but merit's own errors may escape the readers."""

import ast
import json
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from merit_core.checkpoint.resolve import ALL, LATEST, Selection, parse_selection, select_steps
from merit_core.checkpoint.state import (
    NOT_VERIFIED,
    STATE_JSON,
    TrainerState,
    from_dict,
    read_trainer_state,
    verify_checkpoint,
    write_trainer_state,
)
from merit_core.checkpoint.tensors import check_optimizer_state, check_trainer_state
from merit_core.errors import CheckpointError, ConfigError, MeritError

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


def _code_strings(tree: ast.AST) -> list[str]:
    """The string constants of a module that are not docstrings (code, messages, f-string parts)."""
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                docs.add(id(body[0].value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_trainer_state_json_is_named_in_code_by_one_module_only():
    """Every other module asks merit_core.checkpoint.state (its STATE_JSON, its readers) rather than
    spelling the file name and reading it its own way."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / f for f in tracked.stdout.split() if not f.startswith("tests/")]
    assert ROOT / "merit_core/checkpoint/state.py" in files
    naming = sorted(
        str(f.relative_to(ROOT))
        for f in files
        if any("trainer_state.json" in s for s in _code_strings(ast.parse(f.read_text(encoding="utf-8"))))
    )
    assert naming == ["merit_core/checkpoint/state.py"]


def _folder(tmp_path: Path, step: int = 3) -> Path:
    folder = tmp_path / f"step_{step}"
    (folder / "optimizer").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights" * 10)
    (folder / "config.json").write_text('{"n_layer": 2}')
    (folder / "optimizer" / "__0_0.distcp").write_bytes(b"shard")
    write_trainer_state(folder, TrainerState(step=step, optimizer="merit", loss=2.5, max_attention_logit=[1.0, 2.0]))
    return folder


def test_state_round_trips_with_a_checksum_of_every_other_file(tmp_path):
    folder = _folder(tmp_path)
    state = read_trainer_state(folder)
    assert (state.step, state.optimizer, state.loss, state.max_attention_logit) == (3, "merit", 2.5, [1.0, 2.0])
    assert sorted(state.checksums) == ["config.json", "model.safetensors", "optimizer/__0_0.distcp"]
    assert verify_checkpoint(folder) is None


def test_every_field_the_trainer_writes_is_read_back(tmp_path):
    import dataclasses

    folder = tmp_path / "step_4"
    folder.mkdir()
    values = {"data": {"source": "x", "vocab_size": 512}, "max_attention_logit": [0.5, None], "checksums": {}}
    for f in dataclasses.fields(TrainerState):
        if f.name not in values and f.name != "format":
            values[f.name] = "text" if "str" in str(f.type) else 4 if "int" in str(f.type) else 0.25
    written = TrainerState(**values)
    write_trainer_state(folder, written)
    assert read_trainer_state(folder) == written  # no field dropped or retyped on the way back


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "optimizer/__0_0.distcp", STATE_JSON])
def test_a_flipped_byte_in_any_checkpoint_file_is_refused(tmp_path, name):
    folder = _folder(tmp_path)
    path = folder / name
    raw = bytearray(path.read_bytes())
    index = raw.index(b"3") if name == STATE_JSON else len(raw) // 2  # trainer_state.json: its step 3 -> 2
    raw[index] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(folder)
    assert "\n" not in str(caught.value) and ("differs" in str(caught.value) or "altered" in str(caught.value))


def test_a_checkpoint_without_checksums_loads_and_says_it_was_not_verified(tmp_path):
    folder = tmp_path / "step_2"
    folder.mkdir()
    (folder / STATE_JSON).write_text(json.dumps({"format": "merit-trainer-v1", "step": 2, "optimizer": "lamb"}))
    assert read_trainer_state(folder).optimizer == "lamb"
    assert verify_checkpoint(folder) == NOT_VERIFIED
    assert verify_checkpoint(tmp_path) is None  # no trainer_state.json: not a merit checkpoint, nothing recorded


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"step": -5}, "step is -5"),
        ({"step": "7"}, "step is '7'"),
        ({"step": [1, 2]}, r"step is \[1, 2\]"),
        ({"step": True}, "step is true"),
        ({"step": 2.5}, "step is 2.5"),
        ({"tokens": 3}, "no step"),
        ({"step": 1, "lr": "fast"}, "lr is 'fast'"),
        ({"step": 1, "checksums": {"../x": "0" * 64}}, "not a file inside"),
        ({"step": 1, "checksums": {"a": "xyz"}}, "checksums is"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_fields_of_the_wrong_type_are_one_error_line(raw, words):
    with pytest.raises(CheckpointError, match=words) as caught:
        from_dict(raw, "trainer_state.json")
    assert "\n" not in str(caught.value)


def test_steps_selection_parses_the_same_words_for_every_command(tmp_path):
    assert parse_selection("latest") == LATEST and parse_selection(" ALL ") == ALL
    assert parse_selection("12, 5,12") == Selection("steps", (5, 12))
    for bad in ("²", "1.5", "-3", "", ",", "five"):
        with pytest.raises(ConfigError, match="--steps"):
            parse_selection(bad)
    for step in (5, 12):
        _folder(tmp_path, step)
    (tmp_path / "step_20").mkdir()  # no weights: not a checkpoint at any level
    assert [s for s, _ in select_steps(tmp_path, ALL, "weights")] == [5, 12]
    assert select_steps(tmp_path, LATEST, "weights") == [(12, tmp_path / "step_12")]
    assert select_steps(tmp_path, parse_selection("5"), "weights") == [(5, tmp_path / "step_5")]
    with pytest.raises(ConfigError, match="no checkpoint at step 7; it has step_5, step_12"):
        select_steps(tmp_path, parse_selection("7,5"), "weights")
    with pytest.raises(CheckpointError, match="no step_N/ checkpoint with a model"):
        select_steps(tmp_path / "step_20", ALL, "model")


# -- fuzzing the readers ---------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KEYS = st.sampled_from(["step", "tokens", "lr", "optimizer", "checksums", "max_attention_logit", "data", "format"])


@seed(20260)
@FUZZ
@given(st.dictionaries(KEYS, JSON, max_size=6) | JSON)
def test_fuzz_trainer_state_fields(raw):
    try:
        from_dict(raw, "trainer_state.json")
    except MeritError:
        pass


@seed(20261)
@FUZZ
@given(st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzz_trainer_state_bytes(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("state")
    (folder / STATE_JSON).write_bytes(data)
    for read in (read_trainer_state, verify_checkpoint):
        try:
            read(folder)
        except MeritError:
            pass


def _adamw() -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.zeros(3, 2))
    return torch.optim.AdamW([param], lr=1e-3)


TENSORS = st.sampled_from(
    [
        torch.zeros(3, 2),
        torch.zeros(2, 3),
        torch.tensor(1.0),
        torch.tensor(-1.0),
        torch.tensor([1.0, 2.0]),
        torch.zeros(3, 2, dtype=torch.int64),
        torch.zeros(3, 2, dtype=torch.bool),
        torch.zeros(3, 2, device="meta"),
        torch.zeros(1).expand(3, 2),
        torch.tensor(float("nan")),
    ]
)
VALUES = TENSORS | JSON
ENTRY = st.dictionaries(st.sampled_from(["step", "exp_avg", "exp_avg_sq", "other"]), VALUES, max_size=4)
GROUP = st.fixed_dictionaries(
    {"params": st.just([0]) | st.lists(JSON, max_size=2)},
    optional={
        "lr": VALUES,
        "betas": st.tuples(JSON, JSON) | JSON,
        "eps": VALUES,
        "weight_decay": VALUES,
        "amsgrad": JSON,
    },
)
OPTIMIZER_STATE = st.fixed_dictionaries(
    {
        "state": st.dictionaries(st.just(0) | st.integers(-2, 2) | st.text(max_size=3), ENTRY | JSON, max_size=2),
        "param_groups": st.lists(GROUP, max_size=2),
    }
)


@seed(20262)
@FUZZ
@given(OPTIMIZER_STATE | JSON)
def test_fuzz_optimizer_state_against_an_optimizer(state):
    optimizer = _adamw()
    try:
        check_optimizer_state(optimizer, state, "trainer_state.pt")
    except MeritError:
        return
    optimizer.load_state_dict(state)  # what passed the checks loads and steps
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()


@seed(20263)
@FUZZ
@given(
    st.fixed_dictionaries(
        {"step": VALUES, "optimizer": OPTIMIZER_STATE | JSON},
        optional={"rng": st.fixed_dictionaries({"torch": TENSORS | st.just(torch.get_rng_state())}), "data": JSON},
    )
    | JSON
)
def test_fuzz_trainer_state_pt(state):
    try:
        check_trainer_state(state, "trainer_state.pt", step=1)
    except MeritError:
        pass


def test_checks_let_a_real_state_through_and_refuse_the_crafted_ones():
    """The examples the fuzzing generalises: a real AdamW state passes and steps; each crafted one is refused."""
    optimizer = _adamw()
    param = optimizer.param_groups[0]["params"][0]
    param.grad = torch.ones_like(param)
    optimizer.step()
    real = optimizer.state_dict()
    check_optimizer_state(_adamw(), real, "trainer_state.pt")
    entry = real["state"][0]
    group = real["param_groups"][0]
    crafted = {
        "meta-device moment": {**real, "state": {0: {**entry, "exp_avg": torch.zeros(3, 2, device="meta")}}},
        "no exp_avg_sq": {**real, "state": {0: {k: v for k, v in entry.items() if k != "exp_avg_sq"}}},
        "vector step": {**real, "state": {0: {**entry, "step": torch.tensor([1.0, 2.0])}}},
        "text step": {**real, "state": {0: {**entry, "step": "1"}}},
        "negative step": {**real, "state": {0: {**entry, "step": torch.tensor(-3.0)}}},
        "text betas": {**real, "param_groups": [{**group, "betas": "fast"}]},
        "betas past 1": {**real, "param_groups": [{**group, "betas": (0.9, 7.0)}]},
        "negative lr": {**real, "param_groups": [{**group, "lr": -1.0}]},
        "no eps": {**real, "param_groups": [{k: v for k, v in group.items() if k != "eps"}]},
    }
    for name, state in crafted.items():
        with pytest.raises(CheckpointError) as caught:
            check_optimizer_state(_adamw(), state, "trainer_state.pt")
        assert "\n" not in str(caught.value), name
    rng = torch.get_rng_state()
    good = {"step": 4, "optimizer": real, "rng": {"torch": rng}, "data": {"seed": 0, "next_batch": 4}}
    assert check_trainer_state(good, "trainer_state.pt", step=4) == 4
    for bad in ({"step": -5}, {"step": "4"}, {"step": torch.tensor([4])}, {"step": 5}, {"rng": {}}):
        with pytest.raises(CheckpointError):
            check_trainer_state({**good, **bad}, "trainer_state.pt", step=4)
