"""Two `merit eval -o DIR/` finishing in the same second never write one results file.

The name `results-<date>T<time>.json` is taken when the file is written (a rename that never
replaces), not chosen with exists() at the start: both evals keep their own file.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from pathlib import Path

from merit_core.evaluation.results import CheckpointResult, output_file, write_results_json

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5)
STAMP = "results-20260102T030405"


def _record(path: str) -> CheckpointResult:
    return CheckpointResult(path, path, {"task": {"acc,none": 0.5}}, {"eval": {"tasks": ["task"]}})


def _paths_in(folder: Path) -> dict[str, str]:
    """file name -> the checkpoint path its record names."""
    return {p.name: json.loads(p.read_text())["checkpoints"][0]["path"] for p in folder.iterdir()}


def test_two_evals_writing_at_once_into_one_folder_get_a_file_each(tmp_path):
    for n in range(20):
        folder = tmp_path / f"try{n}"
        barrier = threading.Barrier(2)
        written: dict[str, Path] = {}

        def write(
            who: str, folder: Path = folder, barrier: threading.Barrier = barrier, written: dict = written
        ) -> None:
            barrier.wait()
            written[who] = write_results_json(folder, [_record(f"/runs/{who}")], NOW)

        threads = [threading.Thread(target=write, args=(who,)) for who in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert written["a"] != written["b"]
        found = _paths_in(folder)
        assert sorted(found) == [f"{STAMP}-2.json", f"{STAMP}.json"]  # no temp file left either
        assert sorted(found.values()) == ["/runs/a", "/runs/b"]  # each file holds one eval's record
        assert found[written["a"].name] == "/runs/a" and found[written["b"].name] == "/runs/b"


def test_the_name_seen_free_at_the_start_is_not_taken_if_another_eval_wrote_it_meanwhile(tmp_path):
    chosen = output_file(tmp_path, NOW)  # what `merit eval` checks before it starts
    assert chosen.name == f"{STAMP}.json"
    first = write_results_json(tmp_path, [_record("/runs/a")], NOW)  # the other eval finishes first
    second = write_results_json(tmp_path, [_record("/runs/b")], NOW)
    assert (first.name, second.name) == (f"{STAMP}.json", f"{STAMP}-2.json")
    assert _paths_in(tmp_path) == {first.name: "/runs/a", second.name: "/runs/b"}


def test_a_link_planted_at_the_next_name_is_skipped_and_left_alone(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / f"{STAMP}.json")
    os.symlink(tmp_path / "nowhere", out / f"{STAMP}-2.json")
    written = write_results_json(out, [_record("/runs/a")], NOW)
    assert written.name == f"{STAMP}-3.json" and not written.is_symlink()
    assert victim.read_text() == "precious"
    assert os.readlink(out / f"{STAMP}-2.json") == str(tmp_path / "nowhere")
