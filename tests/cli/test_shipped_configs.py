"""Shipped configs by bare name: `merit train gpt2-small`, `merit compare compare-gpt2-small`, --list-configs."""

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.config_catalog import CONFIG_DIR, find_config, shipped_configs
from merit_core.errors import ConfigError


def test_every_shipped_config_states_its_cost_and_has_no_repo_paths():
    configs = shipped_configs()
    assert {c.name for c in configs} >= {"gpt2-tiny", "debug", "gpt2-small", "compare-gpt2-small"}
    for c in configs:
        assert c.cost, f"{c.path} has no '# Cost:' line"
        assert c.summary
        assert "merit_core/configs" not in c.path.read_text()
        assert c.command == ("compare" if c.name.startswith("compare-") else "train")


def test_bare_names_resolve_to_the_shipped_files(tmp_path, monkeypatch):
    assert find_config("gpt2-small", "train") == CONFIG_DIR / "gpt2-small.toml"
    assert find_config("gpt2-small.toml", "train") == CONFIG_DIR / "gpt2-small.toml"
    assert find_config("compare-gpt2-small", "compare") == CONFIG_DIR / "compare-gpt2-small.toml"
    # a file of the user's wins over a shipped name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2-small").write_text('model = "gpt2-tiny"\n')
    assert find_config("gpt2-small", "train").resolve() == tmp_path / "gpt2-small"
    with pytest.raises(ConfigError, match="is a `merit compare` config: merit compare compare-gpt2-small"):
        find_config("compare-gpt2-small", "train")
    with pytest.raises(ConfigError, match="config file not found: gpt2-huge .*shipped train configs: .*gpt2-small"):
        find_config("gpt2-huge", "train")
    with pytest.raises(ConfigError, match="config file not found"):
        find_config("sub/gpt2-small", "train")


def test_list_configs_shows_names_and_costs():
    result = CliRunner().invoke(cli, ["train", "--list-configs"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()  # not a terminal: one whole line per config
    small = next(line for line in lines if line.startswith("merit train gpt2-small "))
    assert "~1.5 H100-hours (~15 min on 8 GPUs)" in small and "GPT-2 Small (124M)" in small
    tiny = next(line for line in lines if line.startswith("merit train gpt2-tiny "))
    assert "~3 minutes on 2 CPU cores" in tiny
    compare = next(line for line in lines if line.startswith("merit compare compare-gpt2-small "))
    assert "~18 H100-hours (~3 h on 8 GPUs)" in compare


def test_unknown_config_name_is_one_line_exit_2():
    result = CliRunner().invoke(cli, ["train", "gpt2-huge"])
    assert result.exit_code == 2
    assert "config file not found: gpt2-huge" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["compare", "gpt2-small"])
    assert result.exit_code == 2 and "merit train gpt2-small" in result.output


def test_compare_plain_line_per_finished_run(capsys):
    from types import SimpleNamespace

    from merit_cli.compare_cmd import RichCompareReport

    report = RichCompareReport()
    assert report.plain  # pytest captures stdout: not a terminal
    report.done, report.total = 0, 2
    run = SimpleNamespace(name="merit-b8-lr0.02", steps=10)
    report.on_run_start(run, resumed=False)
    report.on_run_progress(run, {"step": 10, "loss": 5.0})
    report.on_run_progress(run, {"step": 10, "val_loss": 5.25, "max_attention_logit": [1.5, 2.25]})
    report.on_run_end(run, "finished", None)
    bad = SimpleNamespace(name="adamw-b8-lr0.3", steps=10)
    report.on_run_start(bad, resumed=True)
    report.on_run_end(bad, "diverged", "loss became nan at step 3")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "start run=merit-b8-lr0.02 steps=10"
    assert lines[1].startswith(
        "run run=merit-b8-lr0.02 state=finished runs_done=1/2 val_loss=5.2500 max_logit=2.250 time="
    )
    assert lines[2] == "start run=adamw-b8-lr0.3 steps=10 resumed=True"
    assert lines[3].startswith("run run=adamw-b8-lr0.3 state=diverged runs_done=2/2 time=")
    assert lines[3].endswith("message=loss became nan at step 3")


def test_the_train_package_example_loads_its_config(tmp_path, monkeypatch):
    """merit_core.train's docstring example runs as written from any folder, up to the training itself."""
    import merit_core.train

    monkeypatch.chdir(tmp_path)
    example = [line.strip() for line in merit_core.train.__doc__.splitlines() if line.startswith("    ")]
    assert example[-1] == "summary = run_training(config)"
    scope: dict = {}
    exec("\n".join(example[:-1]), scope)
    assert scope["config"].steps == 20
