"""An MLflow folder's MLmodel (mmserver.codecs.mlmodel): its input example is shown only when
it is a file of the folder itself, never through a link to another model's files."""

from __future__ import annotations

import json
from pathlib import Path

from mmserver.codecs import mlmodel

_INFO = {"saved_input_example_info": {"artifact_path": "input_example.json"}}


def test_the_example_is_the_folder_s_own_file(tmp_path: Path) -> None:
    (tmp_path / "input_example.json").write_text(json.dumps({"columns": ["a"], "data": [[1]]}))
    assert mlmodel.input_example(tmp_path, _INFO) == {"columns": ["a"], "data": [[1]]}


def test_an_example_that_links_elsewhere_is_not_shown(tmp_path: Path) -> None:
    other = tmp_path / "other-customer"
    other.mkdir()
    (other / "input_schema.json").write_text(json.dumps([{"name": "secret", "type": "double"}]))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "input_example.json").symlink_to(other / "input_schema.json")
    assert mlmodel.input_example(folder, _INFO) is None


def test_an_example_outside_the_folder_by_name_is_not_read(tmp_path: Path) -> None:
    for name in ("../input_example.json", ".hidden.json"):
        info = {"saved_input_example_info": {"artifact_path": name}}
        assert mlmodel.input_example(tmp_path, info) is None
