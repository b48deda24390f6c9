"""`alignkit.files`: the one reader of YAML/JSON mappings and the one resolver of paths a config names."""

from __future__ import annotations

import pytest

from alignkit.errors import ConfigError, DataError
from alignkit.files import parse_mapping, resolve_config_path


def test_parse_mapping_yaml_and_json():
    assert parse_mapping("a: 1\nb: [x, y]\n", "c.yaml") == {"a": 1, "b": ["x", "y"]}
    assert parse_mapping("", "c.yaml") == {}  # an empty config sets nothing
    assert parse_mapping('{"a": 1}', "d.json", syntax="json") == {"a": 1}


def test_parse_mapping_errors_name_the_place_and_raise_the_callers_error():
    with pytest.raises(ConfigError, match=r"^c\.yaml: not valid YAML: "):
        parse_mapping("a: [1\n", "c.yaml")
    with pytest.raises(ConfigError, match=r"^c\.yaml: the top level must be a mapping of key: value, got list\.$"):
        parse_mapping("- 1\n", "c.yaml")
    # A multi-line JSON file: line and column; one line (a JSONL row): the column, with the caller's fix.
    with pytest.raises(DataError, match=r"^x\.json: invalid JSON at line 2 column 11 \(Expecting value\)\.$"):
        parse_mapping('{"a":\n  1, "b": }', "x.json", syntax="json", error=DataError)
    with pytest.raises(DataError, match=r"^r\.jsonl line 3: invalid JSON at column 2 \(.*\)\. One per line\.$"):
        parse_mapping("{x}\n", "r.jsonl line 3", syntax="json", error=DataError, hint="One per line.")
    with pytest.raises(DataError, match=r"^r\.jsonl line 3: expected a JSON object, got list\.$"):
        parse_mapping("[1]", "r.jsonl line 3", syntax="json", error=DataError, expected="expected a JSON object")


def test_resolve_config_path_looks_beside_the_config_then_in_the_current_directory(tmp_path, monkeypatch):
    config_dir, cwd = tmp_path / "configs", tmp_path / "work"
    (config_dir / "rm").mkdir(parents=True)
    cwd.mkdir()
    (config_dir / "r.py").write_text("")
    (cwd / "r.py").write_text("")
    (cwd / "only_here.py").write_text("")
    monkeypatch.chdir(cwd)
    assert resolve_config_path("r.py", str(config_dir)) == (config_dir / "r.py").resolve()  # the config's folder first
    assert resolve_config_path("only_here.py", str(config_dir)) == (cwd / "only_here.py").resolve()
    assert resolve_config_path("r.py", None) == (cwd / "r.py").resolve()
    assert resolve_config_path(str(config_dir / "rm"), None, directory=True) == (config_dir / "rm").resolve()
    with pytest.raises(FileNotFoundError, match=r"^looked at .*configs/rm and .*work/rm$"):
        resolve_config_path("rm", str(config_dir))  # a folder, but a file was asked for
