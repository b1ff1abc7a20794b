"""The chief's result file: written whole, never through a link planted at its name."""

from __future__ import annotations

import json

from collective.chief.reports import write_result


def test_the_result_replaces_a_link_planted_at_its_name_and_leaves_the_target_alone(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "result.json").symlink_to(victim)
    write_result(tmp_path / "result.json", {"ok": True})
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "result.json").is_symlink()
    assert json.loads((tmp_path / "result.json").read_text()) == {"ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "victim"]  # no temporary left


def test_a_result_that_cannot_be_written_leaves_no_temporary_and_does_not_raise(tmp_path, caplog):
    (tmp_path / "result.json").mkdir()  # os.replace of a file over a directory fails
    write_result(tmp_path / "result.json", {"ok": False})
    assert "could not write the round's summary" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
