"""Click option helpers shared by the commands: numbers, --device, --dtype, options declared by
merit_core.settings, and their metavars."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from merit_core.errors import CheckpointError, ConfigError
from merit_core.settings import (
    DEVICE_HELP,
    DEVICE_PATTERN,
    DEVICE_WORDS,
    DTYPE_SPELLINGS,
    TrainConfig,
    default_of,
    setting_of,
    shown_default,
    value_type,
)
from merit_core.values import parse_number


class _Number:
    """:func:`number`'s callback: the converter and the metavar it gives its option."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.metavar = "INTEGER" if kind is int else "FLOAT"

    def __call__(self, ctx: click.Context, param: click.Parameter, value: str | None) -> int | float | None:
        if value is None:
            return None
        name = (param.name or "").replace("_", "-")
        return parse_number(value, self.kind, f"--{name}")  # ASCII digits only


def number(kind: type) -> _Number:
    """A click callback: the option's text -> int/float, or a one-line ConfigError naming the option.

    The callback carries the metavar (INTEGER / FLOAT) that `fill_metavars` gives its option, so
    `--help` shows `--lr FLOAT` rather than click's `TEXT` for an untyped option.
    """

    return _Number(kind)


def number_option(name: str, kind: type, *, default: int | float | None = None, help: str):
    """An option holding one int or float, read by `number` (a value that is not one is a one-line
    ConfigError naming the option); its metavar is N for an int, F for a float."""
    return click.option(
        name,
        default=None if default is None else str(default),
        metavar="N" if kind is int else "F",
        callback=number(kind),
        help=help,
    )


class _AsciiDigits:
    """Mixed into click's number types: the text is first read by merit_core.values.parse_number
    (ASCII digits only; click's own int() reads '١٢' as 12), then by click as before."""

    kind: type = int

    def convert(self, value, param, ctx):
        if isinstance(value, str) and param is not None:
            shown = next((o for o in param.opts if o.startswith("--")), param.opts[0] if param.opts else param.name)
            parse_number(value, self.kind, str(shown))
        return super().convert(value, param, ctx)


class _Int(_AsciiDigits, click.types.IntParamType):
    kind = int


class _Float(_AsciiDigits, click.types.FloatParamType):
    kind = float


class _IntRange(_AsciiDigits, click.IntRange):
    kind = int


class _FloatRange(_AsciiDigits, click.FloatRange):
    kind = float


def ascii_numbers(command: click.Command) -> click.Command:
    """Give every int and float option and argument of `command` (plain or a range) the same type
    reading ASCII digits only, whichever command declared it with `type=int`."""
    for param in command.params:
        kind = param.type
        if isinstance(kind, click.IntRange):
            param.type = _IntRange(kind.min, kind.max, kind.min_open, kind.max_open, kind.clamp)
        elif isinstance(kind, click.FloatRange):
            param.type = _FloatRange(kind.min, kind.max, kind.min_open, kind.max_open, kind.clamp)
        elif isinstance(kind, click.types.IntParamType) and not isinstance(kind, _AsciiDigits):
            param.type = _Int()
        elif isinstance(kind, click.types.FloatParamType) and not isinstance(kind, _AsciiDigits):
            param.type = _Float()
    return command


def fill_metavars(command: click.Command) -> click.Command:
    """Give each option converted by a `number` callback (and no metavar of its own) that callback's
    metavar; every number option reads ASCII digits only (`ascii_numbers`)."""
    ascii_numbers(command)
    for param in command.params:
        metavar = getattr(param.callback, "metavar", None)
        if isinstance(param, click.Option) and param.metavar is None and metavar is not None:
            param.metavar = metavar
    return command


def device_callback(ctx, param, value):
    """--device as typed -> lower case, if it is auto, cpu, cuda, cuda:N (or mps); else one ConfigError line."""
    if value is None:
        return None
    name = value.strip().lower()
    if not DEVICE_PATTERN.fullmatch(name):
        raise ConfigError(f"--device {value}: use {DEVICE_WORDS}")
    return name


def device_option():
    """--device for eval and inspect: the words train's `device` setting takes (auto, cpu, cuda or
    cuda:N), auto by default."""
    return click.option(
        "--device",
        default=default_of(TrainConfig, "device"),
        metavar=setting_of(TrainConfig, "device").metavar,
        callback=device_callback,
        help=DEVICE_HELP,
    )


def dtype_callback(allowed: tuple[str, ...]):
    """A click callback: a dtype as users type it (bf16, bfloat16, fp32, ...) -> its full name, one of `allowed`.

    The spellings are merit_core.settings.DTYPE_SPELLINGS, which merit eval reads too, so every command
    reads them alike.
    """

    def convert(ctx, param, value):
        if value is None:
            return None
        word = value.strip().lower()
        name = "auto" if word == "auto" else DTYPE_SPELLINGS.get(word)
        if name not in allowed:
            extra = " (float16 needs loss scaling, which merit train does not do)" if name == "float16" else ""
            raise ConfigError(f"--dtype {value}: use {', '.join(allowed)}{extra}")
        return name

    return convert


CHECKPOINTS_METAVAR = "latest|all|N,M"
_OLD_STEPS = "merit.old_steps"  # ctx.meta key: the selection given with the old spelling --steps


def renamed(old: str, new: str) -> None:
    """One line on stderr: an old spelling of an option still works for this release, under its new name."""
    click.echo(f"note: {old} is now {new}; {old} still works in this release and will be removed", err=True)


def _selection(default: str):
    """A click callback: --checkpoints as typed -> a Selection (merit_core.checkpoint's one parser), or
    one ConfigError line; not given: what the old spelling --steps gave, else `default`."""

    def convert(ctx, param, value):
        from merit_core.checkpoint import parse_selection

        old = ctx.meta.get(_OLD_STEPS)
        if value is not None and old is not None:
            raise ConfigError("give --checkpoints once (--steps is its old spelling)")
        if value is None:
            return old if old is not None else parse_selection(default)
        return parse_selection(value, "--checkpoints")

    return convert


def _old_steps(ctx, param, value):
    """The old spelling --steps of --checkpoints: said once on stderr, then read as --checkpoints."""
    from merit_core.checkpoint import parse_selection

    if value is None:
        return
    renamed("--steps", "--checkpoints")
    if ctx.params.get("selection") is not None:
        raise ConfigError("give --checkpoints once (--steps is its old spelling)")
    ctx.meta[_OLD_STEPS] = parse_selection(value, "--steps")


def steps_option(default: str):
    """--checkpoints latest|all|N,M: which checkpoints of a run folder a command takes, the same words in
    inspect and eval (merit_core.checkpoint.resolve parses and applies them). `--steps` is a number
    of updates (merit train); its old use here still works, hidden, with a one-line notice."""
    from merit_core.checkpoint import STEPS_HELP

    def decorate(command: Any) -> Any:
        command = click.option(
            "--steps", "old_steps", hidden=True, expose_value=False, callback=_old_steps, help="Old spelling."
        )(command)
        return click.option(
            "--checkpoints",
            "selection",
            default=None,
            show_default=default,
            metavar=CHECKPOINTS_METAVAR,
            callback=_selection(default),
            help=STEPS_HELP,
        )(command)

    return decorate


def all_steps_option():
    """--all-steps, kept as another spelling of --checkpoints all (see `selection_of`)."""
    return click.option("--all-steps", is_flag=True, help="The same as --checkpoints all.")


def drop_weights_option():
    """--drop-weights: each hub revision's weights deleted from the hub cache once read, the same flag in
    inspect and eval (merit_core.checkpoint.hub_revisions.HubRequest carries it to the one resolver)."""
    from merit_core.checkpoint.hub_revisions import DROP_WEIGHTS_HELP

    return click.option("--drop-weights", is_flag=True, help=DROP_WEIGHTS_HELP)


def selection_of(selection, all_steps: bool):
    """The Selection --checkpoints and --all-steps make together (--all-steps with other steps: one ConfigError line)."""
    from merit_core.checkpoint import ALL, LATEST

    if not all_steps:
        return selection
    if selection not in (LATEST, ALL):
        raise ConfigError(f"--all-steps is --checkpoints all; it cannot go with --checkpoints {selection}")
    return ALL


def output_option(help: str, *, old: str | None = None, dest: str = "out", **extra: Any):
    """-o/--out PATH: where a command writes its results (a file or a folder), the one spelling of every
    command; `old` (e.g. --output) is an older spelling kept for a release, with a one-line notice."""

    def take_old(ctx, param, value):
        if value is None:
            return
        renamed(str(old), "-o/--out")
        ctx.meta["merit.old_out"] = value

    def decorate(command: Any) -> Any:
        if old is not None:
            command = click.option(old, "old_out", default=None, hidden=True, expose_value=False, callback=take_old)(
                command
            )
        kwargs: dict[str, Any] = {"default": None, "metavar": "PATH", "help": help, **extra}
        return click.option("-o", "--out", dest, **kwargs)(command)

    return decorate


def given_out(out):
    """-o/--out as given, or what its old spelling gave (both: one ConfigError line)."""
    old = click.get_current_context().meta.get("merit.old_out")
    if out is not None and old is not None:
        raise ConfigError("give -o/--out once (the other spelling is its old one)")
    return out if out is not None else old


def check_output(path, option: str = "--out", *, folder: bool = False) -> None:
    """ConfigError unless merit can write `path` (a file, or a folder with `folder`): checked before any
    model is built, so that no work is lost at the end (merit_core.output_checks, which also makes and
    removes a file where it would write)."""
    from pathlib import Path

    from merit_core.output_checks import check_writable, check_writable_folder

    if path is None:
        return
    (check_writable_folder if folder else check_writable)(Path(path).expanduser(), option)


def no_verify_option(what: str = "the checkpoints'"):
    """--no-verify: skip checking a checkpoint's files against the sha256 its trainer_state.json records."""
    return click.option(
        "--no-verify",
        "no_verify",
        is_flag=True,
        help=f"Skip checking {what} files against the checksums recorded when they were written (it says so).",
    )


def setting_help(cls: type, name: str, default: Any = dataclasses.MISSING) -> str:
    """A setting's help as --help shows it: the declared help and, where there is one, its default
    (`default`: another default to show) in click's own `[default: ...]` form."""
    shown = shown_default(cls, name, default)
    return setting_of(cls, name).help + (f"  [default: {shown}]" if shown else "")


def setting_option(
    cls: type,
    name: str,
    *,
    default: Any = dataclasses.MISSING,
    short: str | None = None,
    **extra: Any,
):
    """The option `--NAME` of setting `name` of a merit_core.settings dataclass, as it declares it: its
    kind (value, flag, switch, choice), help, metavar and shown default (`default`: another default
    to show, e.g. compare's own for a train setting). The option's value is None when not given, so
    that the config's own precedence decides; `short` is its one-letter spelling (-o for --out); `extra`
    adds or replaces click arguments (a callback)."""
    declared = setting_of(cls, name)
    flag = "--" + name.replace("_", "-")
    decls: tuple[str, ...] = (flag,) if short is None else (short, flag)
    kwargs: dict[str, Any] = {"help": setting_help(cls, name, default), "show_default": False}
    kwargs["metavar"] = declared.metavar
    if declared.option == "switch":
        decls = (f"{flag}/--no-{flag[2:]}", name)
        kwargs["default"] = None
    elif declared.option == "flag":
        kwargs.update(is_flag=True, default=None)
    elif declared.option == "choice":
        kwargs["type"] = click.Choice(declared.choices or ())
    elif value_type(cls, name) in (int, float):
        kwargs["callback"] = number(value_type(cls, name))
    kwargs.update(extra)
    return click.option(*decls, **kwargs)


def wide_option():
    """--wide for the commands that print tables (inspect, eval, compare): every column unfolded at its
    full width (merit_cli.render.wide_console) instead of tables that fit the terminal."""
    return click.option(
        "--wide",
        is_flag=True,
        help="Print tables with every column at its full width, one line per row, whatever the terminal's "
        "width (for a pipe or a wide terminal); without it a table fits the terminal, its names folding onto "
        "more lines and its columns split into parts.",
    )


FILE_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf")


def check_checkpoint_path(path, hub_name_ok: bool = False) -> None:
    """CheckpointError, in the same words for every command, when `path` is no checkpoint: missing (a
    name that may be a hub model's, with `hub_name_ok`, is left to the hub), or a prepared token file
    or folder of `merit prepare`. Checked before torch loads: a typo is answered at once."""
    from pathlib import Path

    from merit_core.checkpoint import missing_step_hint
    from merit_core.data.meta import is_prepared

    given = Path(path).expanduser()
    if not given.exists():
        parent = given.parent
        local = (
            parent != Path(".")
            and parent.is_dir()
            or str(path).startswith((".", "/", "~"))
            or len(given.parts) > 2
            or given.suffix.lower() in FILE_SUFFIXES  # a file's name, never a hub model's
        )
        if hub_name_ok and not local:
            return
        raise CheckpointError(f"checkpoint not found: {path}{missing_step_hint(given)}")
    folder = given.parent if given.is_file() else given
    if is_prepared(folder):
        what = "a token file" if given.is_file() else "a folder"
        raise CheckpointError(
            f"{path} is {what} of data prepared by merit prepare, not a checkpoint: train on it with "
            f"merit train --data {folder}"
        )
