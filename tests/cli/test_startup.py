"""Issue 30: `alignkit --help`, each command's help, `alignkit train --help-keys` and the config errors a user makes
most (an unknown key, a value of the wrong type, an unknown stage, a dataset that does not exist) come back without
importing torch, transformers, peft or datasets (seconds of imports before anything is said): the key table
(`alignkit.config.keytable`) stands in for the dataclasses.

One fresh interpreter runs the cases in turn through `alignkit.cli.main` and reports which of those packages
it imported: the test process has them loaded already, so only a subprocess can see what the CLI pulls in.
"""

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "peft", "datasets", "accelerate")

SCRIPT = """
import contextlib, io, json, sys
from alignkit.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_info:
            code = exit_info.code
    results.append([code, err.getvalue()])
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"results": results, "heavy": heavy}))
"""


def test_help_and_early_errors_do_not_import_torch(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("stage: [sft\n", encoding="utf-8")
    good_yaml = tmp_path / "c.yaml"
    good_yaml.write_text("stage: sft\ndataset: rows.jsonl\n", encoding="utf-8")
    (tmp_path / "rows.jsonl").write_text('{"instruction": "hi", "output": "hello"}\n', encoding="utf-8")
    cases = [
        (["--help"], 0, ""),
        (["train", "--help"], 0, ""),
        (["eval", "--help"], 0, ""),
        (["score", "--help"], 0, ""),
        (["trian", "c.yaml"], 2, "invalid choice: 'trian'"),
        (["train"], 2, "needs a config file"),
        (["train", str(tmp_path / "missing.yaml")], 2, "does not exist"),
        (["train", str(bad_yaml)], 2, "not valid YAML"),
        (["train", str(good_yaml), "learning_rate"], 2, "is not of the form key=value"),
        (["train", "--help-keys"], 0, ""),
        (["train", str(good_yaml), "learnig_rate=1e-4"], 2, "unknown key `learnig_rate` on the command line"),
        (["train", str(good_yaml), "lora_rank=eight"], 2, "lora_rank='eight' is not a valid int"),
        (["train", str(good_yaml), "stage=sfft"], 2, "stage='sfft' is not a stage"),
        (["train", str(good_yaml), "dataset=nowhere.jsonl"], 2, "dataset 'nowhere.jsonl': no such file"),
        (["train", str(good_yaml), "dataset=no_such_name"], 2, "dataset 'no_such_name' is not a file"),
        (["eval", "--dataset", "demo_math_eval"], 2, "needs --dataset and --reward"),
        (["export", "--export-dir", str(tmp_path / "x"), "--gguf-type", "q8_0"], 2, "add --format gguf"),
    ]
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([argv for argv, _, _ in cases]),
                          json.dumps(HEAVY)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for (argv, code, message), (got_code, err) in zip(cases, report["results"]):
        assert got_code == code and message in err, (argv, got_code, err)
    assert report["heavy"] == [], f"imported before anything ran: {report['heavy']}"
