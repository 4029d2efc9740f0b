"""`tokenfleet simulate` says how far it is while it runs, and saying so changes nothing in the report."""

from __future__ import annotations

import io
import re

from tests.sim.test_fleet import TINY
from tokenfleet.sim import config
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.progress import Progress
from tokenfleet.sim.report import build_report


def _report(fleet: Fleet) -> dict:
    report = build_report(fleet, wall_s=1.0)
    report.pop("wall_s"), report.pop("requests_per_wall_minute")
    return report


def test_progress_lines_name_simulated_time_requests_and_eta_without_changing_the_run() -> None:
    quiet = _report(Fleet(config.parse(TINY)).run())
    out = io.StringIO()
    fleet = Fleet(config.parse(TINY))
    with Progress(fleet, out=out, interval_s=0.005):
        fleet.run()
    assert _report(fleet) == quiet
    lines = out.getvalue().splitlines()
    assert lines, "no progress line while the simulation ran"
    pattern = re.compile(r"simulated [\d,]+ of [\d,]+ s \(\d+%\), [\d,]+ requests, \d+ s so far, about (\d+ s|\?) left")
    assert all(pattern.fullmatch(line) for line in lines), lines[:3]


def test_quiet_flag_is_accepted(capsys) -> None:
    from tokenfleet.cli import main

    assert main(["simulate", "--config", "bench/sim/tiny.yaml", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "simulated" not in captured.err
