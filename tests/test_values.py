"""merit_core.values: the one coercer of settings and hyperparameters (each hint, None, bools that
are not numbers, the one-line wording), positive_int, nest and deep_merge."""

from fractions import Fraction
from typing import Any

import pytest

from merit_core.errors import ConfigError
from merit_core.values import PAIR, coerce, deep_merge, describe, in_range, is_number, nest, parse_number, positive_int


@pytest.mark.parametrize(
    "value, hint, expected",
    [
        (3, float, 3.0),
        (2.5, float, 2.5),
        (Fraction(1, 4), float, 0.25),  # any real number
        (7, int, 7),
        (4.0, int, 4),  # an integral float is an int (TOML writes 4.0 for some counts)
        (True, bool, True),
        (False, bool, False),
        ("gpt2", str, "gpt2"),
        ([0.9, 1], PAIR, (0.9, 1.0)),  # a TOML list becomes a tuple of floats
        ((0.9, 0.95), tuple[float, float], (0.9, 0.95)),
        ({"betas": [0.9, 0.95]}, dict[str, Any], {"betas": [0.9, 0.95]}),
        (None, float | None, None),
        (None, bool | None, None),
        (1, float | None, 1.0),
        ("triton", str | None, "triton"),
    ],
)
def test_each_hint_accepts_and_normalises(value, hint, expected):
    got = coerce(value, hint, "x")
    assert got == expected and type(got) is type(expected)


def test_tables_are_copied():
    table = {"a": 1}
    got = coerce(table, dict[str, Any], "optimizer_args")
    assert got == table and got is not table


@pytest.mark.parametrize(
    "value, hint, message",
    [
        ("fast", float, "lr must be a number, got 'fast'"),
        (True, float, "lr must be a number, got True"),  # a bool is never a number
        (2.5, int, "lr must be an integer, got 2.5"),
        (False, int, "lr must be an integer, got False"),
        (float("nan"), int, "lr must be an integer, got nan"),
        (1, bool, "lr must be true or false, got 1"),
        ("true", bool, "lr must be true or false, got 'true'"),
        (3, str, "lr must be a string, got 3"),
        ((0.9,), PAIR, "lr must be a pair of numbers, got (0.9,)"),
        ([0.9, True], PAIR, "lr must be a pair of numbers, got [0.9, True]"),
        ([0.9, 0.95, 0.99], PAIR, r"lr must be a pair of numbers, got [0.9, 0.95, 0.99]"),
        (3, dict[str, Any], "lr must be a table (e.g. lr.key=value), got 3"),
        (None, float, "lr must be a number, got None"),  # None only where the hint allows it
        ("none", float | None, "lr must be a number or None, got 'none'"),
        ("yes", bool | None, "lr must be true, false or None, got 'yes'"),
        (1, str | None, "lr must be a string or None, got 1"),
    ],
)
def test_a_wrong_value_is_one_line_naming_what_was_expected(value, hint, message):
    with pytest.raises(ConfigError) as caught:
        coerce(value, hint, "lr")
    assert str(caught.value) == message


def test_mention_none_false_leaves_none_out_of_the_words_but_still_accepts_none():
    with pytest.raises(ConfigError) as caught:
        coerce("x", int | None, "micro_batch_size", mention_none=False)
    assert str(caught.value) == "micro_batch_size must be an integer, got 'x'"
    assert coerce(None, int | None, "micro_batch_size", mention_none=False) is None
    assert describe(bool | None, mention_none=False) == "true or false"


def test_hints_outside_the_table_are_programming_errors():
    for hint in (list[int], int | str, int | str | None, "float?", None, complex):
        with pytest.raises(TypeError, match="unsupported type hint"):
            coerce(1, hint, "x")
        with pytest.raises(TypeError):
            describe(hint)


def test_is_number():
    assert is_number(1) and is_number(1.5) and is_number(Fraction(1, 2))
    assert not is_number(True) and not is_number("1") and not is_number(None)


def test_positive_int():
    assert positive_int(8, "jobs") == 8 and positive_int(8.0, "jobs") == 8
    assert positive_int(0, "max_extensions", zero=True) == 0
    for bad in (0, -1, 1.5, True, "3", None):
        with pytest.raises(ConfigError) as caught:
            positive_int(bad, "jobs")
        assert str(caught.value) == f"jobs must be a positive integer, got {bad!r}"
    with pytest.raises(ConfigError, match=r"^max_extensions must be 0 or a positive integer, got -1$"):
        positive_int(-1, "max_extensions", zero=True)


def test_nest_and_deep_merge_layer_dotted_overrides():
    assert nest("lr", 1e-3) == {"lr": 1e-3}
    assert nest("optimizer_args.betas", [0.9, 0.95]) == {"optimizer_args": {"betas": [0.9, 0.95]}}
    base = {"model": "gpt2-tiny", "optimizer_args": {"eps": 1e-8, "betas": [0.9, 0.99]}}
    merged = deep_merge(base, nest("optimizer_args.betas", [0.9, 0.95]))
    assert merged is base
    assert base == {"model": "gpt2-tiny", "optimizer_args": {"eps": 1e-8, "betas": [0.9, 0.95]}}
    deep_merge(base, {"optimizer_args": 3, "seq_len": 64})  # a non-table replaces a table
    assert base == {"model": "gpt2-tiny", "optimizer_args": 3, "seq_len": 64}


@pytest.mark.parametrize(
    "text, kind, expected",
    [
        ("12", int, 12),
        (" 7 ", int, 7),
        ("1_000", int, 1000),
        ("-3", int, -3),
        ("1e-3", float, 0.001),
        ("2", float, 2.0),
    ],
)
def test_parse_number_reads_ascii_numbers(text, kind, expected):
    got = parse_number(text, kind, "--x")
    assert got == expected and type(got) is kind


@pytest.mark.parametrize("text", ["²", "١٢", "１２", "٣.٥", "1e3", "abc", "", "12x", "⁵"])
def test_parse_number_refuses_digits_that_are_not_ascii_and_non_numbers(text):
    kind = float if "." in text else int
    with pytest.raises(ConfigError, match=r"^--x must be (an integer|a number), got "):
        parse_number(text, kind, "--x")
    assert int("١٢") == 12  # what int() alone would have accepted


def test_parse_number_checks_a_number_given_as_such_like_coerce():
    assert parse_number(5, int, "--x") == 5
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_number(True, int, "--x")


@pytest.mark.parametrize("value", [0, 1, 2**32 - 1, 4.0])
def test_in_range_accepts_its_bounds(value):
    assert in_range(value, 0, 2**32 - 1, "--seed") == int(value)


@pytest.mark.parametrize("value", [-1, 2**32, 2**64, 1.5, "3", True, None])
def test_in_range_refuses_in_one_line_with_the_bounds(value):
    with pytest.raises(ConfigError, match=r"^--seed must be an integer from 0 to 2\*\*32 - 1, got "):
        in_range(value, 0, 2**32 - 1, "--seed")
