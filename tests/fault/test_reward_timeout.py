"""A reward function that never returns stops the run instead of hanging it (issue 31 item 6).

Before, `alignkit train` waited on such a function forever, with no message. Now a call that takes longer than
`reward_timeout` seconds stops the process with exit status 2 and a message naming the function and the rows it
was scoring; the stuck call is left in a daemon thread, which does not keep the process alive. The checkpoint saved
before the hang is sound, and the same command resumes from it once the function returns again.

Real `python -m alignkit` processes on the tiny model, GRPO with a checkpoint every step; the function hangs (a
ten-minute sleep) from its second call on, i.e. in the second step's generation round. Bounded: each process has
a deadline, and the whole test takes seconds beyond the two processes' start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.fault

ROOT = Path(__file__).resolve().parents[2]
REWARDS = """
    import os
    import time

    calls = 0

    def maybe_hangs(prompts, completions, **kwargs):
        global calls
        calls += 1
        if os.environ.get("HANG_FROM_CALL") and calls >= int(os.environ["HANG_FROM_CALL"]):
            time.sleep(600)  # as good as forever for this test
        return [float(len(str(c)) % 3) for c in completions]
"""


def test_a_hanging_reward_function_stops_the_run_and_the_checkpoint_resumes(tmp_path, tiny_model_dir):
    from alignkit.lifecycle import checkpoint_problem

    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS), encoding="utf-8")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + 2?"}) + "\n"
                                                    for i in range(8)), encoding="utf-8")
    out = tmp_path / "out"
    (tmp_path / "grpo.yaml").write_text(textwrap.dedent(f"""\
        stage: grpo
        model_name_or_path: {tiny_model_dir}
        dataset: prompts.jsonl
        reward_funcs: rewards.py:maybe_hangs
        reward_timeout: 2
        output_dir: {out}
        per_device_train_batch_size: 4
        num_generations: 4
        max_completion_length: 4
        cutoff_len: 64
        max_steps: 3
        save_steps: 1
        logging_steps: 1
        lora_rank: 4
        seed: 0
        use_cpu: true
        disable_tqdm: true
    """), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")

    def train(**extra_env):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "alignkit", "train", str(tmp_path / "grpo.yaml")],
                              env={**env, **extra_env}, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start

    code, output, seconds = train(HANG_FROM_CALL="2")
    assert code == 2, output[-3000:]
    assert "alignkit: error: reward function maybe_hangs did not return within reward_timeout=2 s, scoring rows 0-3 " \
           "of 4" in output
    assert "rewards.py:maybe_hangs" in output and "Traceback" not in output
    assert seconds < 240  # it did not wait for the ten-minute call
    assert checkpoint_problem(out / "checkpoint-1", True) is None
    assert not (out / "checkpoint-2").exists() and not (out / "adapter_model.safetensors").exists()

    code, output, _ = train()
    assert code == 0, output[-3000:]
    assert "Resuming from" in output and "checkpoint-1" in output
    assert (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
