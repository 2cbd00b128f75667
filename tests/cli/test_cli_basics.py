"""The `merit` entry points: version, help, module execution, one-line errors."""

import subprocess
import sys

from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.version import __version__


def test_version_and_help():
    runner = CliRunner()
    out = runner.invoke(cli, ["--version"])
    assert out.exit_code == 0 and __version__ in out.output
    out = runner.invoke(cli, ["--help"])
    assert out.exit_code == 0 and "merit" in out.output


def test_python_dash_m_works():
    proc = subprocess.run([sys.executable, "-m", "merit_cli", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_unknown_command_exits_2():
    out = CliRunner().invoke(cli, ["frobnicate"])
    assert out.exit_code == 2


def test_every_train_option_is_a_config_key_declared_once():
    """`merit train`'s options reach load_config under their own names: each must be a TrainConfig key."""
    import dataclasses

    from merit_cli.train_cmd import CONFIG_OPTIONS, train
    from merit_core.train.config import TrainConfig

    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    # --yes answers the start confirmation: an option of the command, not a setting of the run
    options = [p.name for p in train.params if p.name not in ("config_file", "list_configs", "overrides", "yes")]
    assert len(options) == len(CONFIG_OPTIONS) == len(set(options))
    assert set(options) <= keys, set(options) - keys


def test_the_rich_reports_answer_every_hook():
    """merit train's and merit compare's reports write each TrainCallbacks / CompareCallbacks hook out
    (their modules are read at --help, so they do not subclass the torch-importing classes): a hook added
    there must be added to the report too."""
    from merit_cli.compare_cmd import RichCompareReport
    from merit_cli.train_cmd import RichTrainReport
    from merit_core.compare.runner import CompareCallbacks
    from merit_core.train.callbacks import TrainCallbacks

    for report, callbacks, sample in (
        (RichCompareReport, CompareCallbacks, "on_run_end"),
        (RichTrainReport, TrainCallbacks, "stop_requested"),
    ):
        hooks = {name for name, value in vars(callbacks).items() if not name.startswith("_") and callable(value)}
        assert sample in hooks
        assert [h for h in sorted(hooks) if not callable(getattr(report, h, None))] == [], report
