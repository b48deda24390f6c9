"""Bad input stops `alignkit train` with exit 2 and a message naming the file, line or key, before the model
loads (issue 10 item 7); a config silent on do_* trains and do_predict runs on `dataset` (item 8).

"Before the model loads" is checked, not timed: `load_model` is replaced by a function that fails the
test if any stage calls it.
"""

from __future__ import annotations

import errno
import logging
import json
import shutil
import tempfile

import pytest

from alignkit.cli import main

ROWS = [{"instruction": f"What is {i} plus 2?", "output": f"{i} plus 2 is {i + 2}."} for i in range(12)]


@pytest.fixture
def no_model_load(monkeypatch):
    """Make loading model weights fail the test: these errors must come before it."""
    import alignkit.model.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input error was reported")

    monkeypatch.setattr(loader, "load_model", refuse)


def _config(tmp_path, model_dir, body: str = "do_train: true\n", **data) -> str:
    data_path = tmp_path / "data.jsonl"
    if not data_path.exists():
        data_path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n", encoding="utf-8")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"stage: sft\nmodel_name_or_path: {model_dir}\ndataset: {data.get('dataset', data_path)}\n"
                   f"cutoff_len: 64\nmax_samples: 8\nper_device_train_batch_size: 2\nmax_steps: 1\n"
                   f"save_strategy: 'no'\noutput_dir: {tmp_path / 'out'}\n{body}", encoding="utf-8")
    return str(cfg)


def _train(capsys, *argv) -> tuple[int, str]:
    code = main(["train", *argv])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- data files
def test_non_utf8_jsonl_names_file_line_and_byte(tmp_path, tiny_model_dir, capsys, no_model_load):
    lines = [json.dumps(r).encode() for r in ROWS]
    lines[4] = b'{"instruction": "caf\xe9", "output": "ok"}'  # a Latin-1 e-acute on line 5
    (tmp_path / "latin1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir, dataset=tmp_path / "latin1.jsonl"))
    assert code == 2
    # 4 lines before it plus their newlines, then `{"instruction": "caf` (20 bytes): column 21.
    offset = sum(len(line) + 1 for line in lines[:4]) + 20
    assert f"latin1.jsonl, line 5: column 21 (byte offset {offset}, 0xe9) is not UTF-8" in err
    assert "skip_invalid_rows" in err and "iconv" in err


def test_non_utf8_json_document_says_skip_invalid_rows_cannot_help(tmp_path, tiny_model_dir, capsys, no_model_load):
    (tmp_path / "latin1.json").write_bytes(b'[{"instruction": "caf\xe9", "output": "ok"}]')
    cfg = _config(tmp_path, tiny_model_dir, dataset=tmp_path / "latin1.json")
    code, err = _train(capsys, cfg, "skip_invalid_rows=true")
    assert code == 2
    assert "latin1.json: line 1, column 22 (byte offset 21, 0xe9) is not UTF-8" in err
    assert "skip_invalid_rows cannot skip" in err and ".jsonl" in err


# ---------------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("override", ["learning_rate=-1", "per_device_train_batch_size=0",
                                      "gradient_accumulation_steps=0", "num_train_epochs=-1 max_steps=-1"])
def test_out_of_range_training_numbers_exit_2_naming_the_key(tmp_path, tiny_model_dir, capsys, no_model_load,
                                                             override):
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir), *override.split())
    assert code == 2
    key = override.split("=")[0]
    assert f"alignkit: error: {key}=" in err


def test_fp16_on_a_cpu_exits_2(tmp_path, tiny_model_dir, capsys, no_model_load, monkeypatch):
    import alignkit.config.parse as parse

    monkeypatch.setattr(parse, "_has_accelerator", lambda: False)  # also on a machine that has a GPU
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir), "fp16=true")
    assert code == 2 and "fp16=true needs a GPU" in err


# ---------------------------------------------------------------------------------------------- model folder
def _copy_model(tiny_model_dir, tmp_path, name="model"):
    target = tmp_path / name
    shutil.copytree(tiny_model_dir, target)
    return target


def test_model_folder_without_weights_exits_2_before_tokenising(tmp_path, tiny_model_dir, capsys, no_model_load,
                                                                 monkeypatch):
    import alignkit.data as data

    monkeypatch.setattr(data, "get_dataset", lambda *a, **k: pytest.fail("the data was tokenised first"))
    model = _copy_model(tiny_model_dir, tmp_path)
    (model / "model.safetensors").unlink()
    code, err = _train(capsys, _config(tmp_path, model))
    assert code == 2
    assert f"model_name_or_path='{model}' has a config.json but no weights" in err


def test_truncated_weights_exit_2_naming_the_file(tmp_path, tiny_model_dir, capsys, no_model_load):
    model = _copy_model(tiny_model_dir, tmp_path)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    code, err = _train(capsys, _config(tmp_path, model))
    assert code == 2
    assert "model.safetensors is damaged or incomplete" in err and "copy them again" in err


def test_sharded_model_with_a_missing_shard_exits_2_naming_the_shard(tmp_path, tiny_model_dir, capsys, no_model_load):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = _copy_model(tiny_model_dir, tmp_path)
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (model / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(model / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00002-of-00002.safetensors").unlink()
    code, err = _train(capsys, _config(tmp_path, model))
    assert code == 2
    assert "model-00002-of-00002.safetensors (listed in model.safetensors.index.json) is missing" in err


def test_sharded_model_that_is_whole_passes_the_check(tmp_path, tiny_model_dir):
    from alignkit.model.weight_files import check_model_files

    check_model_files(tiny_model_dir)  # the fixture's single-file model
    model = _copy_model(tiny_model_dir, tmp_path)
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(model / "model-00001-of-00001.safetensors"), framework="pt") as f:
        weight_map = {k: "model-00001-of-00001.safetensors" for k in f.keys()}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    check_model_files(model)


def test_truncated_pytorch_bin_is_reported(tmp_path, tiny_model_dir):
    import torch

    from alignkit.errors import ConfigError
    from alignkit.model.weight_files import check_model_files

    model = _copy_model(tiny_model_dir, tmp_path)
    (model / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(64, 64)}, model / "pytorch_model.bin")
    check_model_files(model)
    data = (model / "pytorch_model.bin").read_bytes()
    (model / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="pytorch_model.bin is incomplete"):
        check_model_files(model)


# ---------------------------------------------------------------------------------------------- output_dir
def test_output_dir_that_is_a_file_exits_2(tmp_path, tiny_model_dir, capsys, no_model_load):
    (tmp_path / "taken").write_text("not a folder")
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir), f"output_dir={tmp_path / 'taken' / 'run'}")
    assert code == 2
    assert f"lies under {tmp_path / 'taken'}, which is a file" in err


def test_output_dir_on_a_read_only_file_system_exits_2(tmp_path, tiny_model_dir, capsys, no_model_load, monkeypatch):
    # Tests may run as root, for whom chmod cannot make a folder read-only: fail the probe as a read-only
    # mount does.
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryDirectory", read_only)
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir))
    assert code == 2
    assert "cannot be written (Read-only file system" in err and "writable file system" in err


def test_output_dir_probe_leaves_nothing_behind(tmp_path):
    from alignkit.train import check_output_dir

    check_output_dir(tmp_path / "new" / "run")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "run").mkdir()
    check_output_dir(tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []


# ---------------------------------------------------------------------------------------------- item 8
def test_config_without_do_keys_trains(tmp_path, tiny_model_dir, capsys):
    code, _ = _train(capsys, _config(tmp_path, tiny_model_dir, body=""))
    assert code == 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "train_results.json").read_text())["epoch"] > 0


def test_do_predict_without_training_predicts_on_dataset(tmp_path, tiny_model_dir, capsys):
    body = "do_predict: true\npredict_with_generate: true\nmax_new_tokens: 2\n"
    code, _ = _train(capsys, _config(tmp_path, tiny_model_dir, body=body))
    assert code == 0
    out = tmp_path / "out"
    assert not (out / "adapter_model.safetensors").exists()  # nothing trained
    records = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert [r["label"] for r in records] == [r["output"] for r in ROWS[:8]]  # the first max_samples rows


# ---------------------------------------------------------------------------------------------- broken adapters
@pytest.fixture
def no_weights_load(monkeypatch):
    """`arm()` makes every transformers weight load from then on fail the test (chat, score and eval bind their
    loaders at import, so `no_model_load`'s stand-in would not see them)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("model weights were loaded before the broken adapter was reported")

    def arm():
        for auto in ("AutoModelForCausalLM", "AutoModelForSequenceClassification"):
            monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", refuse)

    return arm


def _break_adapter(folder, how: str) -> None:
    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    if how == "only_config":
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        config.write_text('{"peft_type": "LORA", "r": ', encoding="utf-8")


@pytest.mark.parametrize("how", ["only_config", "truncated", "config_not_json"])
@pytest.mark.parametrize("command", ["chat", "score", "eval"])
def test_a_broken_adapter_folder_exits_2_naming_it(tmp_path, tiny_model_dir, capsys, save_perturbed_adapter,
                                                    no_weights_load, how, command):
    """An adapter folder with only its config, cut-short weights or a config that is not JSON: chat, score and eval
    stop with exit 2 and one line naming the folder, before any weights load (export: tests/fault/test_export.py)."""
    adapter = tmp_path / "adapter"
    save_perturbed_adapter(tiny_model_dir, adapter, head="reward" if command == "score" else "causal_lm")
    _break_adapter(adapter, how)
    no_weights_load()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "What is 2 plus 2?", "response": "4"}) + "\n", encoding="utf-8")
    argv = {"chat": ["chat", "--model", tiny_model_dir, "--adapter", str(adapter), "--prompt", "hi"],
            "score": ["score", "--model", str(adapter), "--input", str(pairs)],
            "eval": ["eval", "--model", tiny_model_dir, "--adapter", str(adapter), "--dataset", str(pairs),
                     "--reward", "length", "--max-new-tokens", "4"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("alignkit: error:") == 1 and str(adapter) in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------------------------- DeepSpeed JSON
DS_OK = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "zero_optimization": {"stage": 2}}


@pytest.fixture
def one_process_env(monkeypatch):
    """The variables `alignkit train` gives a DeepSpeed run started alone, restored after the test."""
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("case, body, keys, expected", [
    ("a JSON list", "[1, 2]", "", r"ds\.json: a DeepSpeed config must be a JSON object, got list"),
    ("not JSON", '{"zero_optimization": {"stage": 2}', "", r"ds\.json: invalid JSON at column 35"),
    ("ZeRO stage 7", {**DS_OK, "zero_optimization": {"stage": 7}}, "", r"ds\.json: zero_optimization\.stage=7"),
    ("fp16 on a CPU", {**DS_OK, "fp16": {"enabled": True}}, "", r"ds\.json: fp16\.enabled is true, but there is no GPU"),
    ("micro batch", {**DS_OK, "train_micro_batch_size_per_gpu": 4}, "",
     r"ds\.json: train_micro_batch_size_per_gpu=4 but per_device_train_batch_size=2"),
    ("no accumulation key", {k: v for k, v in DS_OK.items() if k != "gradient_accumulation_steps"},
     "gradient_accumulation_steps: 8\n", r"ds\.json has no gradient_accumulation_steps.*sets gradient_accumulation_steps=8"),
    ("total batch", {**DS_OK, "train_batch_size": 16}, "",
     r"ds\.json: train_batch_size=16, but .* = 2 x 1 x 1 = 2"),
])
def test_a_deepspeed_json_that_disagrees_exits_2_naming_the_file_and_key(
        tmp_path, tiny_model_dir, capsys, no_model_load, one_process_env, case, body, keys, expected):
    """What DeepSpeed answered with an assertion traceback from each process after the model loaded."""
    import re

    ds = tmp_path / "ds.json"
    ds.write_text(body if isinstance(body, str) else json.dumps(body), encoding="utf-8")
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir, body=f"do_train: true\ndeepspeed: {ds}\n{keys}"))
    assert code == 2, (case, err)
    assert re.search(expected, err) and "Traceback" not in err, (case, err)


def test_a_deepspeed_scheduler_block_is_said_to_replace_the_configs_schedule(tmp_path, caplog):
    """The check alone: a whole config with `deepspeed` would also start DeepSpeed's process group here."""
    from alignkit.config.deepspeed import check_deepspeed_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**DS_OK, "scheduler": {"type": "WarmupLR", "params": {}}}), encoding="utf-8")
    caplog.set_level(logging.WARNING, logger="alignkit.config.deepspeed")
    check_deepspeed_config(str(ds), micro_batch=2, grad_accum=1, processes=1, on_gpu=False)
    assert f"{ds} has a scheduler block: DeepSpeed's WarmupLR schedule replaces the config's lr_scheduler_type" \
        in caplog.text


# ---------------------------------------------------------------------------------------------- issue 32
def test_a_typo_given_on_the_command_line_is_attributed_to_it(tmp_path, tiny_model_dir, capsys, no_model_load):
    """`learnig_rate=1e-4` after the YAML is the command line's mistake, not the file's."""
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir), "learnig_rate=1e-4")
    assert code == 2
    assert "unknown key `learnig_rate` on the command line (learnig_rate=1e-4)" in err
    assert "c.yaml" not in err and "learning_rate" in err


def test_a_typo_in_the_file_still_names_the_file(tmp_path, tiny_model_dir, capsys, no_model_load):
    code, err = _train(capsys, _config(tmp_path, tiny_model_dir, body="learnig_rate: 1e-4\n"))
    assert code == 2 and "unknown key `learnig_rate` in " in err and "c.yaml" in err
