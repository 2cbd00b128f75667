"""Running `merit` in-process for tests: :func:`invoke` (a command's exception re-raised, so a
failing test shows the traceback) and :func:`train_args` (a `merit train` command line for a tiny
run, its settings as ``--set key=value``)."""

from click.testing import CliRunner

from merit_cli.main import cli

# A tiny run: 8-sequence batches of 32 tokens in two micro-batches, evaluated and saved every 2 updates.
TINY_TRAIN = dict(
    batch_size=8,
    micro_batch_size=4,
    seq_len=32,
    lr=3e-3,
    eval_every=2,
    save_every=2,
    log_every=1,
    eval_batches=2,
    eval_batch_size=4,
)


def invoke(args):
    """`merit ARGS` through click's runner; an exception other than SystemExit is raised again."""
    result = CliRunner().invoke(cli, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def train_args(model_cfg, data_dir, out, *extra, settings: dict = TINY_TRAIN) -> list[str]:
    """`train --model MODEL_CFG --data DATA_DIR --out OUT` with ``settings`` as --set, then ``extra``."""
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    return ["train", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(out), *sets, *extra]
