"""``collective launch --json`` on Ctrl-C: the summary line it prints (Launcher.interrupted_summary).

The whole command is in tests/integration/test_interrupts.py (a run held in its join phase);
here the case a real run gives only in a half-second window: a Ctrl-C after start was
released, while the chief answers status watchers (its status grace), which the chief does not
survive (killed by SIGINT there)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from collective.chief.reports import failed_summary
from collective.cli.launch import Child, Launcher


@dataclass
class _Ended:
    returncode: int
    pid: int = 4242


def _launcher(tmp_path, summary: dict | None, codes: dict[str, int]) -> Launcher:
    launcher = Launcher(workers=2, run_dir=str(tmp_path / "run"))
    if summary is not None:
        launcher._result_file = tmp_path / "result.json"
        launcher._result_file.write_text(json.dumps(summary))
    for label, code in codes.items():  # launch stopped the chief (SIGINT) on the Ctrl-C
        launcher.children.append(Child(label, _Ended(code), tmp_path / f"{label}.log", stopped=label == "chief"))
    launcher.interrupted = True
    return launcher


def test_a_ctrl_c_after_start_was_released_keeps_the_rounds_outcome(tmp_path):
    started = {**failed_summary(None, transport="grpc", model="preset mlp (seed 0)"), "ok": True, "exit_code": 0}
    result = _launcher(tmp_path, started, {"chief": -2, "worker 0": 0, "worker 1": 0}).interrupted_summary()
    assert (result["ok"], result["exit_code"], result["error"], result["failed_processes"]) == (True, 130, None, {})
    assert result["warnings"] == ["interrupted (SIGINT) after start was released: only the chief's linger was cut "
                                  "short"], result


def test_a_ctrl_c_before_the_chief_wrote_anything_is_named_by_launch(tmp_path):
    result = _launcher(tmp_path, None, {"chief": -2}).interrupted_summary()
    assert (result["ok"], result["exit_code"], result["failed_processes"]) == (False, 130, {}), result
    assert result["error"] == "interrupted (SIGINT): every process of the run was stopped"
