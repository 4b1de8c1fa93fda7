"""`kvgate bench hot-path`: every stage of the cache-aware path runs on the gateway's real parts."""

from __future__ import annotations

import argparse

from kvgate.bench.hot_path import _stages, run


def test_every_stage_runs_and_is_reported(capsys):
    stages = _stages(instances=4)
    assert len(stages) == 7
    for _, call in stages:
        call()
    assert run(argparse.Namespace(instances=4, repeats=5, max_seconds=1.0)) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "stage" not in line]
    assert len(rows) == 7 and any("hash + keys" in row for row in rows)


def test_whole_plan_row_times_the_planner_on_the_inline_path(capsys):
    # The planner with the embedded index never suspends; _completed raises if it ever does.
    assert run(argparse.Namespace(instances=2, repeats=5, max_seconds=1.0, whole_plan=True)) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "stage" not in line]
    assert len(rows) == 8 and "whole plan (RoutePlanner.plan)" in rows[-1]
    assert int(rows[-1].split("|")[-2]) == 5  # every timed call completed
