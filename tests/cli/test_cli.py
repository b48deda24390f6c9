"""The `alignkit` command, run in-process."""

import pytest

from alignkit.cli import main


def test_misspelled_key_exits_non_zero_naming_the_right_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: sft\n")
    assert main(["train", str(cfg), "learnig_rate=1e-4"]) == 2
    err = capsys.readouterr().err
    assert "learnig_rate" in err and "learning_rate" in err


def test_overrides_after_nproc_are_overrides(tmp_path, capsys, monkeypatch):
    """`train CONFIG --nproc 2 key=value` reads key=value as an override, as the other orders do (argparse alone
    stops the positional list at the option); the config is checked before any launch, so a misspelled key there
    fails here, naming it, and an option word argparse does not know is still refused."""
    import alignkit.launch

    monkeypatch.setattr(alignkit.launch, "relaunch", lambda command: pytest.fail(f"launched {command}"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: sft\n")
    for argv in (["train", str(cfg), "--nproc", "2", "learnig_rate=1e-4"],
                 ["train", "--nproc", "2", str(cfg), "learnig_rate=1e-4"],
                 ["train", str(cfg), "learnig_rate=1e-4", "--nproc", "2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "learnig_rate" in err and "learning_rate" in err and "unrecognized" not in err, (argv, err)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(cfg), "--nproc", "2", "--no-such-option"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_missing_config_file_is_a_clear_error(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_keys_lists_every_key_under_its_section(capsys):
    """The groups are the ones README.md and docs/config.md name (issue 32); transformers' 120-odd training keys
    are folded under one heading into their names and a link to their help."""
    from alignkit.config.parse import TRANSFORMERS_TRAINING_DOCS

    assert main(["train", "--help-keys"]) == 0
    out = capsys.readouterr().out
    sections: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        elif line.startswith("  "):
            current.append(line.strip())
    keys = {title: [line.split(":")[0] for line in lines] for title, lines in sections.items()}
    assert list(sections)[:5] == ["model", "data", "finetuning", "generation", "training"]
    assert {"model_name_or_path"} <= set(keys["model"])
    assert {"cutoff_len", "packing"} <= set(keys["data"])
    assert {"stage", "lora_rank"} <= set(keys["finetuning"])
    assert {"max_new_tokens"} <= set(keys["generation"])
    assert {"overwrite_output_dir", "padding_free", "plot_loss"} <= set(keys["training"])
    assert "pref_beta" in keys["stage dpo"]
    assert keys["stage rm"] == ["center_rewards_coefficient", "disable_dropout"]
    folded = sections["training (transformers)"]
    assert folded[0].split()[0].isdigit() and int(folded[0].split()[0]) > 100
    assert TRANSFORMERS_TRAINING_DOCS in folded[1]
    names = {name.strip() for line in folded[2:] for name in line.split(",")}
    assert {"learning_rate", "per_device_train_batch_size", "max_steps"} <= names
    assert "learning_rate:" not in out  # folded: names only, the help is transformers'


def test_readme_and_config_docs_name_the_help_keys_groups():
    """docs/config.md's key table uses the groups `--help-keys` prints, and README.md says it groups them."""
    from pathlib import Path

    from alignkit.config.parse import TRANSFORMERS_TRAINING_GROUP, all_keys

    root = Path(__file__).resolve().parents[2]
    config_doc = (root / "docs" / "config.md").read_text(encoding="utf-8")
    table_groups = {line.split("|")[1].strip() for line in config_doc.splitlines() if line.startswith("| ")}
    assert set(all_keys()) - {TRANSFORMERS_TRAINING_GROUP} <= table_groups
    assert TRANSFORMERS_TRAINING_GROUP in config_doc
    assert "alignkit train --help-keys" in (root / "README.md").read_text(encoding="utf-8")


def test_broken_jsonl_line_exits_non_zero_naming_file_and_line(tmp_path, tiny_model_dir, capsys):
    import json

    lines = [json.dumps({"instruction": f"question {i}", "output": f"answer {i}"}) for i in range(10)]
    lines[6] = '{"instruction": "question 6", "output": "answer 6"'  # line 7 lacks its closing brace
    data = tmp_path / "broken.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"stage: sft\ndo_train: true\nmodel_name_or_path: {tiny_model_dir}\ndataset: {data}\n"
                   f"output_dir: {tmp_path / 'out'}\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "broken.jsonl" in err and "line 7" in err and "skip_invalid_rows" in err
    assert not (tmp_path / "out" / "trainer_state.json").exists()


def test_the_board_shows_by_default_the_folder_every_example_writes_to():
    """Issue 32: the default `--runs` was `outputs/` while every example writes under `saves/` (and a run without
    output_dir and the demo wrote under `outputs/`)."""
    from pathlib import Path

    import yaml

    from alignkit.cli import build_parser

    runs = build_parser().parse_args(["board"]).runs
    examples = sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml"))
    tops = {Path(yaml.safe_load(p.read_text())["output_dir"]).parts[0] for p in examples}
    assert examples and tops == {runs} == {"saves"}
    # A run without output_dir, and the demo, land there too.
    from alignkit.config.parse import parse_config

    assert Path(parse_config({}).training.output_dir).parts[0] == runs
    assert Path(build_parser().parse_args(["demo"]).output_dir).parts[0] == runs


def test_no_deepspeed_cpu_notice_on_stdout_unless_deepspeed_is_used(tmp_path, tiny_model_dir):
    """Issue 32: with deepspeed installed, accelerate imports it in every run, and on a machine without GPUs
    DeepSpeed printed `[WARNING] [real_accelerator.py:...] Setting accelerator to CPU` on stdout for every train
    and export. A run without DeepSpeed shows no such line; what else DeepSpeed's logger says still shows."""
    import json
    import logging
    import subprocess
    import sys

    from alignkit.env import DEEPSPEED_CPU_NOTICE, silence_deepspeed_cpu_notice

    (tmp_path / "d.json").write_text(json.dumps([{"instruction": "a", "output": "b"}] * 2), encoding="utf-8")
    (tmp_path / "c.yaml").write_text(f"stage: sft\nmodel_name_or_path: {tiny_model_dir}\ndataset: d.json\n"
                                     "cutoff_len: 32\nper_device_train_batch_size: 2\nmax_steps: 1\n"
                                     "save_strategy: 'no'\noutput_dir: out\n", encoding="utf-8")
    # `export` and the other commands call the same function unconditionally (`alignkit.cli.main`).
    run = subprocess.run([sys.executable, "-m", "alignkit", "train", "c.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert DEEPSPEED_CPU_NOTICE not in run.stdout + run.stderr and "real_accelerator" not in run.stdout

    silence_deepspeed_cpu_notice()
    silence_deepspeed_cpu_notice()  # once is enough: the filter is not added twice
    ds_logger = logging.getLogger("DeepSpeed")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    ds_logger.addHandler(handler)
    try:
        ds_logger.warning(f"{DEEPSPEED_CPU_NOTICE}. If you have GPU or other accelerator, we were unable to detect it.")
        ds_logger.warning("something else")
    finally:
        ds_logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["something else"]
    assert sum(f is ds_logger.filters[0] for f in ds_logger.filters) == 1
