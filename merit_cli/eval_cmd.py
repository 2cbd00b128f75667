"""`merit eval`: zero-shot LAMBADA / WikiText / SuperGLUE (or any lm-eval task) on checkpoints."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import click
from rich.console import Console

from merit_cli.eval_tables import aliases_table, results_table, steps_table
from merit_cli.options import (
    all_steps_option,
    check_checkpoint_path,
    check_output,
    device_option,
    drop_weights_option,
    given_out,
    no_verify_option,
    output_option,
    selection_of,
    steps_option,
    wide_option,
)
from merit_cli.render import ProgressView, print_table, print_whole, shown, wide_console
from merit_core.checkpoint.hub_revisions import REVISIONS_HELP, hub_request
from merit_core.errors import ConfigError
from merit_core.evaluation import EvalSettings, evaluate_checkpoints
from merit_core.evaluation.backends import HF, SPLIT_KEYS, VLLM_KEYS, backend_of
from merit_core.evaluation.lm_eval_output import parse_seed
from merit_core.evaluation.results import (
    CheckpointResult,
    check_output_path,
    metric_rows,
    output_file,
    write_results_json,
)
from merit_core.evaluation.tasks import check_task_code_trusted, split_task_list

_NOISY_LOGGERS = ("lm_eval", "transformers", "datasets", "accelerate", "huggingface_hub")


def _quiet_libraries() -> None:
    """Keep lm-eval / transformers / datasets chatter (logs, tqdm bars) off the console."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


# lm-eval's spellings of merit eval's options (lm_eval --model hf --model_args pretrained=... --output_path ...)
LM_EVAL_FLAGS = {
    "--batch_size": "--batch-size",
    "--num_fewshot": "--num-fewshot",
    "--include_path": "--include-path",
    "--bootstrap_iters": "--bootstrap-iters",
    "--log_samples": "--log-samples",
}
# lm-eval options merit eval has no equivalent for, and what to use instead
LM_EVAL_REFUSED = {
    "--write_out": "--write_out prints example prompts; merit eval --log_samples --output_path DIR writes the "
    "prompt, target and response of every document to DIR/<model>/samples_<task>_<time>.jsonl",
    "--apply_chat_template": "--apply_chat_template formats prompts for chat models; merit eval scores base models "
    "(merit checkpoints have no chat template): run lm_eval itself for a chat model",
    "--fewshot_as_multiturn": "--fewshot_as_multiturn goes with chat templates, which merit eval does not apply: "
    "run lm_eval itself for a chat model",
    "--system_instruction": "--system_instruction goes with chat templates, which merit eval does not apply: "
    "run lm_eval itself for a chat model",
}
# keys of lm-eval's --model_args that merit eval has (pretrained= is the CKPT argument)
MODEL_ARGS = {"dtype": "--dtype", "device": "--device", "batch_size": "--batch-size"}


def _lm_eval_args(args: list[str]) -> list[str]:
    """lm-eval's command line in merit eval's words, or a ConfigError with merit's exact equivalent.

    `--batch_size` & co become `--batch-size` & co; `--model hf` is what merit eval always does;
    `--model_args pretrained=P,dtype=D` becomes the argument P and `--dtype D`.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out += args[i - 1 :]
            break
        name, eq, inline = arg.partition("=")
        if name in LM_EVAL_REFUSED:
            raise ConfigError(LM_EVAL_REFUSED[name])
        if name == "--output_path":  # lm-eval's own results layout (and merit's JSON there unless -o says where)
            out.append("--lm-eval-output" + eq + inline)
            continue
        if name in LM_EVAL_FLAGS:
            out.append(LM_EVAL_FLAGS[name] + eq + inline)
            continue
        if name not in ("--model", "--model_args"):
            out.append(arg)
            continue
        if not eq:
            if i >= len(args):
                raise ConfigError(f"{name} needs a value")
            inline, i = args[i], i + 1
        if name == "--model_args":  # recorded as given in lm-eval's results file
            out += ["--lm-eval-model-args", inline]
        if name == "--model":
            out += ["--lm-eval-model", backend_of(inline)]  # vllm where it is missing: one line
            continue
        out += _model_args(inline)
    return out


def _model_args(text: str) -> list[str]:
    """`pretrained=P,dtype=D,...` -> ['P', '--dtype', 'D', ...]; a key merit eval lacks is refused."""
    out: list[str] = []
    for item in (part for part in text.split(",") if part.strip()):
        key, eq, value = item.partition("=")
        key = key.strip()
        if key == "pretrained" and eq:
            if not value.strip():  # an empty path would mean the current folder
                raise ConfigError("--model_args pretrained= is empty; give the checkpoint: pretrained=CKPT")
            out.insert(0, value)
        elif key in MODEL_ARGS and eq:
            out += [MODEL_ARGS[key], value]
        elif key in SPLIT_KEYS + VLLM_KEYS and eq:  # lm-eval's model placement, checked against --model later
            out += ["--lm-eval-model-arg", f"{key}={value}"]
        elif key == "trust_remote_code":
            raise ConfigError(
                "--model_args trust_remote_code: merit eval runs a checkpoint's own Python code only when given "
                "--trust-remote-code (only for checkpoints you trust)"
            )
        else:
            raise ConfigError(
                f"--model_args {key}: merit eval takes pretrained=CKPT as the CKPT argument and "
                f"{', '.join(f'{k}= as {v}' for k, v in MODEL_ARGS.items())}, and lm-eval's "
                f"{', '.join(SPLIT_KEYS)} (--model hf) or {', '.join(VLLM_KEYS)} (--model vllm); it has no {key!r}"
            )
    return out


def _chosen_steps(checkpoints: tuple, selection, all_steps: bool, plot: str | None):
    """The selection --checkpoints / --all-steps make; checks that a selection other than the latest (scores
    over steps) has one run folder and that --plot comes only with one."""
    from merit_core.checkpoint import LATEST

    selection = selection_of(selection, all_steps)
    if selection == LATEST:
        if plot is not None:
            raise ConfigError("--plot draws scores over steps: give it with --checkpoints all or --checkpoints N,M")
        return selection
    if len(checkpoints) != 1:
        raise ConfigError(f"--checkpoints {selection} takes one `merit train` run folder")
    if plot is not None:
        from merit_core.output_checks import check_writable

        if not plot.lower().endswith((".png", ".pdf", ".svg")):
            raise ConfigError(f"--plot {plot}: use a .png, .pdf or .svg file name")
        check_writable(plot, "--plot")
    return selection


def _show_steps(
    console, run: str, steps: list[int], records: list[CheckpointResult], plot: str | None, taken=None, logits=None
) -> None:
    """The steps table, the recorded max logit in each record's meta (`logits`: measured while scoring,
    with --drop-weights) and, with --plot, the figure."""
    from pathlib import Path

    from merit_core.evaluation.steps import RECORDED_LOGIT, plot_steps, recorded_max_logits

    if logits is None:
        logits = recorded_max_logits(Path(run).expanduser(), taken)
    for step, record in zip(steps, records):
        record.meta[RECORDED_LOGIT] = logits.get(step)
    print_table(console, steps_table(steps, records, logits))
    if plot is not None:
        rows = metric_rows(records)
        series = {f"{r.task} {r.metric}": list(r.values) for r in rows}
        plot_steps(steps, series, [logits.get(s) for s in steps], plot)
        print_whole(console, f"wrote {shown(plot)}")


class EvalCommand(click.Command):
    """`merit eval`, which also reads lm-eval's spellings of its options (see `_lm_eval_args`)."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, _lm_eval_args(list(args)))


def _display_stream():
    """A stderr stream that stays visible while the library silences file descriptor 2."""
    try:
        return os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. click's test runner)
        return None


@click.command("eval", cls=EvalCommand, context_settings={"show_default": True})
@click.argument("checkpoints", nargs=-1, metavar="CKPT...")
@click.option("--tasks", "-t", default=None, help="Comma-separated tasks or aliases, e.g. lambada,wikitext,superglue.")
@click.option(
    "--include-path",
    type=str,
    default=None,
    metavar="DIR",
    help="Folder of lm-eval task YAMLs (local data); one with code (Python, !function, templates that "
    "compute) needs --trust-task-code.",
)
@device_option()
@click.option(
    "--dtype",
    default="auto",
    metavar="DTYPE",
    help="Weights' dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 (fp32) or bfloat16 (bf16) "
    "(float16 also works); recorded in the JSON's meta.eval.dtype. Scores differ slightly between dtypes.",
)
@click.option("--batch-size", default="auto", metavar="INTEGER|auto", help="Sequences per forward pass, or auto.")
@click.option("--limit", type=int, default=None, help="Score only the first N documents of each task (quick runs).")
@click.option("--num-fewshot", type=int, default=0, help="Few-shot examples per prompt.")
@click.option(
    "--bootstrap-iters", type=int, default=100000, help="Bootstrap draws for stderrs (0: none); lm-eval's default."
)
@output_option(
    "Write all results as JSON: to PATH when it is a file name (results.json; a file of that name is "
    "replaced whole, never half-written), else into the folder PATH (a new results-<date>T<time>.json, "
    "never one that exists), as merit prepare -o names a folder.",
    old="--output",
    dest="output",
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Run Python code shipped with a checkpoint (its config's auto_map). Off by default: only for "
    "checkpoints you trust.",
)
@click.option(
    "--log-samples",
    is_flag=True,
    help="Also write every document's prompt, target and score, as lm-eval's --log_samples does: "
    "OUTPUT/<model>/samples_<task>_<time>.jsonl (needs --output_path).",
)
@click.option(
    "--seed",
    default="0,1234,1234,1234",
    metavar="N|P,N,T,F",
    help="lm-eval's seeds (python, numpy, torch, few-shot sampler); one integer sets all four.",
)
@click.option(
    "--lm-eval-output", default=None, hidden=True, help="Set by --output_path DIR: lm-eval's files go into DIR."
)
@click.option("--lm-eval-model-args", default=None, hidden=True, help="Set by --model_args: recorded as given.")
@click.option("--lm-eval-model", default=HF, hidden=True, help="Set by --model: hf or vllm.")
@click.option(
    "--lm-eval-model-arg",
    multiple=True,
    hidden=True,
    help="Set by --model_args parallelize=True & co: passed to lm-eval.",
)
@click.option(
    "--devices",
    default=None,
    metavar="LIST|all",
    help="Score in parallel, one worker process per device listed: cuda:0,cuda:1, all (every visible GPU) "
    "or cpu,cpu (two CPU processes, the cores shared out). The results are one device's, in step order (shared "
    "requests are batched per worker, so a score may round differently); --share says what the workers share.",
)
@click.option(
    "--share",
    "split",
    type=click.Choice(["checkpoints", "requests"]),
    default=None,
    help="What the --devices workers share: checkpoints (each worker scores whole checkpoints, the next when "
    "it finishes one; the default when there are at least as many checkpoints as devices) or requests (each "
    "checkpoint in turn is loaded by every worker and its requests are cut into one share per worker; the "
    "default for fewer checkpoints, e.g. one CKPT). Recorded as the JSON's devices.split.  [default: by the "
    "number of checkpoints]",
)
@click.option(
    "--trust-task-code",
    is_flag=True,
    help="Read the --include-path task folder, which is code: a YAML !function imports its Python and "
    "lm-eval renders prompts with Jinja, which can run commands. Off by default: only for task folders you "
    "trust. Separate from --trust-remote-code, which trusts a checkpoint's code, not a task folder's.",
)
@steps_option(default="latest")
@all_steps_option()
@click.option("--revisions", help="A hub model ORG/NAME scored over its revisions: " + REVISIONS_HELP)
@drop_weights_option()
@no_verify_option()
@click.option(
    "--plot",
    default=None,
    metavar="PATH",
    help="With --checkpoints all / N,M: scores over steps beside the recorded max logit (.png/.pdf/.svg).",
)
@click.option("--list-tasks", is_flag=True, help="Show the task aliases (and --include-path tasks) and exit.")
@click.option("--verbose", "-v", is_flag=True, help="Show lm-eval's own logs and progress bars.")
@wide_option()
def eval_cmd(
    checkpoints,
    tasks,
    include_path,
    device,
    dtype,
    batch_size,
    limit,
    num_fewshot,
    bootstrap_iters,
    output,
    trust_remote_code,
    log_samples,
    seed,
    lm_eval_output,
    lm_eval_model_args,
    lm_eval_model,
    lm_eval_model_arg,
    devices,
    split,
    trust_task_code,
    selection,
    all_steps,
    revisions,
    drop_weights,
    no_verify,
    plot,
    list_tasks,
    verbose,
    wide,
):
    """Zero-shot evaluation of checkpoints with lm-evaluation-harness.

    CKPT is a Hugging Face model folder, a `merit train` run folder (its latest step_N is used) or a
    hub model name. Aliases: builtin (offline), lambada, wikitext, superglue (see --list-tasks).

    \b
    Examples:
      merit eval runs/gpt2-merit --tasks lambada,wikitext
      merit eval runs/a runs/b --tasks superglue --limit 200 -o results.json
      merit eval runs/a --include-path my_tasks --trust-task-code --tasks my_task -o eval-results/
      merit eval runs/first --tasks builtin            # offline: the built-in corpus's held-out text
      merit eval --model hf --model_args pretrained=runs/a/step_100 --tasks builtin \\
          --output_path evals --log_samples           # lm-eval's spellings and its results layout
      merit eval runs/a --checkpoints all --tasks builtin --plot scores.png -o steps.json
      merit eval runs/a --checkpoints all --tasks lambada,wikitext --devices all -o steps.json  # a worker per GPU
      merit eval runs/a/step_900 --tasks lambada --devices all   # one checkpoint's requests over the GPUs
      merit eval --model_args pretrained=runs/big/step_900,parallelize=True,max_memory_per_gpu=70GiB \\
          --tasks lambada                              # one model over the node's GPUs (lm-eval's)

    lm-eval's spellings work too: --model hf, --model_args pretrained=CKPT,dtype=D (and lm-eval's
    parallelize=True, max_memory_per_gpu=, max_cpu_memory=, offload_folder=, device_map=; with --model vllm,
    where vLLM is installed, tensor_parallel_size=, data_parallel_size=, gpu_memory_utilization=,
    max_model_len=), --batch_size, --num_fewshot, --include_path, --bootstrap_iters, --log_samples, --seed;
    --output_path DIR writes lm-eval's DIR/<model>/results_<time>.json, the file lm-eval's own command
    line writes for the same run, and merit's JSON into DIR too unless -o names its place.
    """
    console = wide_console(Console()) if wide else Console()
    check_task_code_trusted(include_path, trust_task_code)
    if list_tasks:
        console.print(aliases_table(include_path))
        return

    if not checkpoints:
        raise ConfigError("no checkpoint given: merit eval CKPT... --tasks lambada,wikitext")
    for checkpoint in checkpoints:  # a local typo in inspect's words at once; a hub name is left to the hub
        check_checkpoint_path(checkpoint, hub_name_ok=True)
    if not tasks or not split_task_list(tasks):
        raise ConfigError(
            "no task given: pass --tasks, e.g. --tasks builtin (offline) or lambada,wikitext (see --list-tasks)"
        )
    settings = EvalSettings(
        tasks=split_task_list(tasks),
        include_path=include_path,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        limit=limit,
        num_fewshot=num_fewshot,
        bootstrap_iters=bootstrap_iters,
        trust_remote_code=trust_remote_code,
        verify=not no_verify,
        log_samples=log_samples,
        seed=parse_seed(seed),
        backend=lm_eval_model,
        model_args=tuple(_key_value(item) for item in lm_eval_model_arg),
    ).validated()
    workers = _workers(devices, device, split)
    if log_samples and not lm_eval_output:
        raise ConfigError(
            "--log_samples needs --output_path DIR: the samples go to DIR/<model>/samples_<task>_<time>.jsonl"
        )
    lm_eval_dir = lm_eval_output
    output = given_out(output) or lm_eval_output  # merit's JSON beside lm-eval's files unless -o names its place
    if output:
        check_output_path(output_file(output))  # the name is taken when the file is written
        check_output(output_file(output))  # a folder that refuses a file: before any model is built
    # which checkpoints: resolved once, said with the results (so that a bad option, task or checkpoint
    # stays one line) from the same resolution the harness is handed
    from merit_core.checkpoint import LATEST
    from merit_core.evaluation.steps import eval_targets

    selection = _chosen_steps(checkpoints, selection, all_steps, None if revisions else plot)
    if drop_weights and workers is not None and len(workers) > 1:
        raise ConfigError("--drop-weights scores one revision at a time in this process: leave out --devices")
    hub = hub_request(revisions, drop_weights, trust_remote_code)
    targets = eval_targets(checkpoints, selection, hub)
    step_run = checkpoints[0] if selection != LATEST or revisions else None
    chosen = targets.taken[0].steps if step_run is not None else []
    if step_run is not None:
        checkpoints = targets.checkpoints  # lm-eval's files name each step folder evaluated

    from merit_core.hub import prefer_offline

    prefer_offline()  # before lm-eval / datasets / transformers are imported
    if not verbose:
        _quiet_libraries()
    if lm_eval_dir:  # a link at DIR/<model> is refused now, not after the scoring
        from merit_core.evaluation.lm_eval_output import check_model_folders

        check_model_folders(lm_eval_dir, checkpoints)

    # The display holds its own stderr: in quiet mode the library silences sys.stderr and fd 2 while it runs.
    notes: list[str] = []
    own = _display_stream()
    try:
        display = Console(file=own or sys.stderr, stderr=own is None)
        with ProgressView(display, one_line=True, first="loading torch and lm-eval", redirect=False) as view:
            measured = None  # each revision's max logit, measured while scoring with --drop-weights
            if drop_weights:
                from merit_core.evaluation.hub_logits import score_one_at_a_time

                outcome, measured = score_one_at_a_time(
                    targets.checkpoints, settings, hub, chosen or None, view, not verbose, notes.append
                )
            else:
                outcome = _score(list(targets.checkpoints), settings, workers, split, view, not verbose, notes.append)
    finally:
        if own is not None:
            own.close()
    for text in targets.lines():
        console.print(f"[dim]{shown(text)}[/]", soft_wrap=True)
    for text in notes:
        console.print(f"[yellow]note[/] {shown(text)}", soft_wrap=True)

    records, extra = outcome.records, outcome.json_extra()
    if outcome.missing:  # what was scored: a checkpoint a worker lost is left out, and said below
        checkpoints = tuple(checkpoints[i] for i in outcome.scored)
        chosen = [chosen[i] for i in outcome.scored] if chosen else chosen
    if records:
        print_table(console, results_table(records, settings.num_fewshot))
    if step_run is not None and records:
        _show_steps(console, step_run, chosen, records, plot, targets.taken[0], measured)
    if output:
        path = write_results_json(output, records, extra=extra) if extra else write_results_json(output, records)
        print_whole(console, f"wrote {shown(path)}")
    if lm_eval_dir and records:
        given = LmEvalGiven(
            checkpoints, lm_eval_model_args, dtype, batch_size, include_path, lm_eval_model, settings.model_args
        )
        _write_lm_eval_layout(console, lm_eval_dir, records, given)
    if outcome.missing:
        from merit_core.errors import RunFailed

        for lost in outcome.missing[:-1]:
            console.print(f"[red]not scored[/] {shown(lost.error)}", soft_wrap=True)
        raise RunFailed(f"not scored: {outcome.missing[-1].error}")


def _workers(devices: str | None, device: str, split: str | None) -> tuple[str, ...] | None:
    """--devices read (merit_core.evaluation.worker_processes.parse_devices), or None for the one-process run."""
    if devices is None:
        if split is not None:
            raise ConfigError(f"--share {split} is what the --devices workers share: give --devices too")
        return None
    if device not in ("auto", None):
        raise ConfigError(f"give --device {device} or --devices {devices}, not both")
    from merit_core.evaluation.worker_processes import parse_devices

    return parse_devices(devices)


def _score(checkpoints: list[str], settings, workers: tuple[str, ...] | None, split, view, quiet: bool, note):
    """The checkpoints scored in this process, or with --devices by one worker process per device."""
    from merit_core.evaluation.workers import Outcome, evaluate_on_devices

    if workers is None:
        records = evaluate_checkpoints(checkpoints, settings, progress=view, quiet=quiet, note=note)
        return Outcome(records, list(range(len(records))))
    return evaluate_on_devices(checkpoints, settings, workers, view, quiet, note, split)


def _key_value(item: str) -> tuple[str, str]:
    key, _, value = item.partition("=")
    return key.strip(), value


@dataclasses.dataclass(frozen=True)
class LmEvalGiven:
    """What the user typed, which lm-eval's results file records as typed: the checkpoints (lm-eval's
    pretrained=, also its folder name), --model_args, --dtype, --batch-size, --include-path, --model and
    the model placement keys of --model_args."""

    checkpoints: tuple[str, ...]
    model_args: str | None
    dtype: str
    batch_size: str
    include_path: str | None
    model: str = HF
    placement: tuple[tuple[str, str], ...] = ()  # lm-eval's parallelize=True & co as given


def _write_lm_eval_layout(
    console: Console, output_path: str, records: list[CheckpointResult], given: LmEvalGiven
) -> None:
    """lm-eval's own files for each checkpoint (merit_core.evaluation.lm_eval_output)."""
    from merit_core.evaluation.lm_eval_output import write_lm_eval_results

    typed = given.checkpoints if len(given.checkpoints) == len(records) else tuple(r.path for r in records)
    for name, record in zip(typed, records):
        used = record.meta.get("eval", {})
        if given.model_args is not None and len(records) == 1:
            model_args = given.model_args
        else:  # what `lm_eval --model_args` would have been for these options
            model_args = f"pretrained={name}" + (f",dtype={given.dtype}" if given.dtype != "auto" else "")
            model_args += "".join(f",{key}={value}" for key, value in given.placement)
        settings = {
            "model": given.model,
            "model_args": model_args,
            "batch_size": given.batch_size if given.batch_size != "auto" else used.get("batch_size"),
            "device": used.get("device"),
            "include_path": given.include_path,
        }
        for path in write_lm_eval_results(output_path, name, record.lm_eval or {}, settings):
            print_whole(console, f"wrote {shown(path)}")
