"""`alignkit eval` on the tiny model: reward means over a prompt file, per-row output, adapters, errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from alignkit.cli import main

ROWS = [
    {"prompt": "What is 2 + 2?", "answer": "4"},
    {"instruction": "Add the numbers.", "input": "7 and 5", "answer": "12"},
    {"prompt": "Name a colour.", "answer": None},
    {"prompt": "How many legs does a spider have?", "answer": "8"},
]
REWARDS = """
    def answer_value(prompts, completions, answer, **kwargs):
        # The row's answer as the reward: a hand-checkable mean (None where the row has none).
        return [float(a) if a is not None else None for a in answer]

    def completion_chars(prompts, completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    def fails_on_spiders(prompts, completions, **kwargs):
        return [1.0 / ("spider" not in p[-1]["content"]) for p in prompts]
"""


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(
        {"prompt": r.get("prompt") or r["instruction"] + "\n" + r["input"], "answer": r["answer"]}) for r in ROWS),
        encoding="utf-8")
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS), encoding="utf-8")
    return tmp_path


def _eval(workspace, tiny_model_dir, *extra, monkeypatch=None):
    args = ["eval", "--model", tiny_model_dir, "--dataset", str(workspace / "prompts.jsonl"),
            "--dataset-dir", str(workspace), "--max-new-tokens", "6", "--batch-size", "3", *extra]
    return main(args)


def test_means_rows_and_columns(workspace, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.chdir(workspace)  # file.py:function relative to the working directory
    out_file = workspace / "rows.jsonl"
    code = _eval(workspace, tiny_model_dir, "--reward", "my_rewards.py:answer_value", "--reward", "accuracy",
                 "--reward", "my_rewards.py:completion_chars", "--reward-weights", "1,1,0", "--output", str(out_file))
    printed = capsys.readouterr().out
    assert code == 0
    # answer_value: answers 4, 12, 8 (one row has none) -> (4 + 12 + 8) / 3 = 8.
    assert "answer_value: 8.0000 (mean over 3 of 4 rows)" in printed
    rows = [json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 4 and [r["answer"] for r in rows] == [r["answer"] for r in ROWS]
    assert rows[2]["rewards"]["answer_value"] is None and rows[2]["rewards"]["accuracy"] is None
    chars = [r["rewards"]["completion_chars"] for r in rows]
    assert chars == [float(len(r["completion"])) for r in rows]
    assert all(r["completion_tokens"] <= 6 for r in rows)
    accuracy = [r["rewards"]["accuracy"] for r in rows if r["rewards"]["accuracy"] is not None]
    assert f"accuracy: {sum(accuracy) / 3:.4f} (mean over 3 of 4 rows)" in printed
    # Weighted sum with weights 1, 1, 0 over the rows scored by any function (all 4: completion_chars
    # scores every row): the answers plus accuracy, row 2 contributing 0.
    expected = (4 + 12 + 8 + sum(accuracy)) / 4
    assert f"reward (weighted sum): {expected:.4f}" in printed


def test_greedy_is_repeatable_and_the_adapter_is_used(workspace, tiny_model_dir, tmp_path, save_perturbed_adapter,
                                                      capsys):
    adapter = tmp_path / "adapter"
    save_perturbed_adapter(tiny_model_dir, adapter)
    texts = {}
    for name, extra in (("base", []), ("again", []), ("adapter", ["--adapter", str(adapter)])):
        out_file = workspace / f"{name}.jsonl"
        assert _eval(workspace, tiny_model_dir, "--reward", "length", "--output", str(out_file), *extra) == 0
        texts[name] = [json.loads(line)["completion_tokens"] for line in out_file.read_text().splitlines()], \
            [json.loads(line)["completion"] for line in out_file.read_text().splitlines()]
    assert texts["base"] == texts["again"]
    assert texts["adapter"] != texts["base"]
    assert f"+ {adapter}" in capsys.readouterr().out


def test_completions_are_model_generates_greedy_ones(workspace, tiny_model_dir, monkeypatch):
    """Issue 30: eval decodes on the rollouts' loop (`generate_with_decode`: packed weights, its own KV cache);
    each batch's greedy completions are those `model.generate` gives for the same prompts, token for token."""
    import torch

    import alignkit.model.generation as generation

    batches = []
    decode = generation.generate_with_decode

    def decode_and_generate(model, tokenizer, input_ids, attention_mask, **kwargs):
        out = decode(model, tokenizer, input_ids, attention_mask, **kwargs)
        batches.append((out, generation.generate(model, tokenizer, input_ids, attention_mask, **kwargs)))
        return out

    monkeypatch.setattr(generation, "generate_with_decode", decode_and_generate)
    assert _eval(workspace, tiny_model_dir, "--reward", "length", "--max-new-tokens", "12") == 0
    assert [len(out.texts) for out, _ in batches] == [2, 2]  # at most 3 a batch: as few as that allows, equal
    for out, expected in batches:
        assert out.texts == expected.texts
        assert torch.equal(out.completion_mask, expected.completion_mask)
        assert torch.equal(out.completion_ids[out.completion_mask.bool()],
                           expected.completion_ids[expected.completion_mask.bool()])


@pytest.mark.parametrize("setting, bf16", [(None, False), ("bf16=false", False), ("bf16=true", True)])
def test_bf16_true_decodes_under_bf16_autocast(workspace, tiny_model_dir, monkeypatch, capsys, setting, bf16):
    """`bf16=true` decodes under bf16 autocast (`packed_linears` then packs bf16 copies); the default decodes in
    fp32, so an evaluation's answers do not depend on the machine's bf16 hardware. The header says which."""
    import torch

    import alignkit.config.parse as parse_module
    import alignkit.model.generation as generation

    monkeypatch.setattr(parse_module, "_cpu_has_bf16", lambda: True)  # whatever this machine has
    seen = []
    decode = generation.generate_with_decode

    def recording(model, tokenizer, input_ids, attention_mask, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return decode(model, tokenizer, input_ids, attention_mask, **kwargs)

    monkeypatch.setattr(generation, "generate_with_decode", recording)
    assert _eval(workspace, tiny_model_dir, "--reward", "length", *([setting] if setting else [])) == 0
    assert seen and all(enabled == bf16 for enabled, _ in seen)
    assert all(dtype == torch.bfloat16 for enabled, dtype in seen if enabled)
    assert (", greedy, bf16," in capsys.readouterr().out) == bf16
    assert not torch.is_autocast_enabled("cpu")


def test_the_batch_width_does_not_change_the_greedy_answers(workspace, tiny_model_dir):
    """The default batch (every prompt of this set at once) gives the rows one prompt at a time gives, token for
    token: left padding and the attention mask keep each row to its own prompt."""
    rows = {}
    for name, extra in (("one", ["--batch-size", "1"]), ("default", [])):
        out_file = workspace / f"{name}.jsonl"
        args = ["eval", "--model", tiny_model_dir, "--dataset", str(workspace / "prompts.jsonl"), "--dataset-dir",
                str(workspace), "--max-new-tokens", "12", "--reward", "length", "--output", str(out_file), *extra]
        assert main(args) == 0
        rows[name] = [json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines()]
    assert [(r["completion"], r["completion_tokens"], r["truncated"]) for r in rows["default"]] == \
        [(r["completion"], r["completion_tokens"], r["truncated"]) for r in rows["one"]]


def test_a_failing_reward_function_is_a_clean_error(workspace, tiny_model_dir, capsys):
    code = _eval(workspace, tiny_model_dir, "--reward", f"{workspace / 'my_rewards.py'}:fails_on_spiders")
    err = capsys.readouterr().err
    assert code == 2
    # At most 3 a batch, 4 prompts: two batches of 2; the spider prompt is row 1 of the second call, and the
    # message shows its prompt.
    assert "reward function fails_on_spiders raised ZeroDivisionError" in err
    assert "on row 1 of 2 (prompt [{'role': 'user', 'content': 'How many legs does a spider have?'}]" in err


def test_reward_settings_as_key_value(workspace, tiny_model_dir, capsys):
    # Everything matches `.*`, so format is 1.0 on every row; the length reward takes its window from the key.
    code = _eval(workspace, tiny_model_dir, "--reward", "format", "--reward", "length", "format_reward_pattern=.*",
                 "length_reward_window=2")
    printed = capsys.readouterr().out
    assert code == 0 and "format: 1.0000 (mean over 4 of 4 rows)" in printed
    assert main(["eval", "--dataset", "x"]) == 2  # --reward is required (or --tasks)
    assert "needs --dataset and --reward" in capsys.readouterr().err
    assert _eval(workspace, tiny_model_dir, "--reward", "format", "length_reward_window=0") == 2
    assert "length_reward_window=0 must be >= 1" in capsys.readouterr().err


def test_answer_kl_against_hand_computed_numbers():
    """KL(p || p_ref) over the vocabulary, position by position.

    p = [0.5, 0.5], p_ref = [0.25, 0.75]: 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.5 (0.693147 - 0.405465)
    = 0.143841. Equal distributions give 0; adding a constant to the logits changes nothing.
    """
    import math

    import torch

    from alignkit.evaluate import answer_kl

    logits = torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.8]]))
    ref_logits = torch.log(torch.tensor([[0.25, 0.75], [0.2, 0.8]])) + 3.0
    kl = answer_kl(logits, ref_logits)
    assert kl.shape == (2,)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    assert kl[0].item() == pytest.approx(0.143841, abs=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-6)


def test_answers_kl_equals_a_forward_of_each_answer_alone(tiny_model_dir, tmp_path, save_perturbed_adapter):
    """The batched, left-padded answers give the KL that each prompt + answer run alone through both models gives."""
    import torch

    from alignkit.evaluate import answer_kl, answers_kl
    from alignkit.config.parse import parse_config
    from alignkit.model.generation import generate, pad_prompts
    from alignkit.model.loader import load_model, load_tokenizer

    save_perturbed_adapter(tiny_model_dir, tmp_path / "adapter")
    config = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": str(tmp_path / "adapter")})
    model = load_model(config.model, config.finetuning, is_trainable=False)
    reference = load_model(parse_config({"model_name_or_path": tiny_model_dir}).model, config.finetuning,
                           is_trainable=False)
    tokenizer = load_tokenizer(config.model)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # unequal lengths: left padding in the batch
    input_ids, attention_mask = pad_prompts(prompts, tokenizer.pad_token_id)
    out = generate(model, tokenizer, input_ids, attention_mask, stop_token_ids=[tokenizer.eos_token_id],
                   generation_kwargs={"do_sample": False, "max_new_tokens": 5})
    kl = answers_kl(model, reference, out, tokenizer.pad_token_id)
    assert kl.shape == (3,) and (kl > 0).all()
    for i, prompt in enumerate(prompts):
        answer = out.completion_ids[i][out.completion_mask[i].bool()].tolist()
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            # Positions len(prompt) - 1 ... predict the answer's tokens.
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            ref_logits = reference(input_ids=ids).logits[0, len(prompt) - 1:-1]
        assert kl[i].item() == pytest.approx(answer_kl(logits, ref_logits).sum().item(), rel=1e-4, abs=1e-6)
    assert answers_kl(reference, reference, out, tokenizer.pad_token_id).abs().max().item() < 1e-6


def test_eval_reports_the_kl_to_a_reference(workspace, tiny_model_dir, tmp_path, save_perturbed_adapter, capsys):
    adapter = tmp_path / "adapter"
    save_perturbed_adapter(tiny_model_dir, adapter)
    out_file = workspace / "kl.jsonl"
    assert _eval(workspace, tiny_model_dir, "--reward", "length", "--adapter", str(adapter), "--kl-reference", "base",
                 "--output", str(out_file)) == 0
    printed = capsys.readouterr().out
    kls = [json.loads(line)["kl"] for line in out_file.read_text(encoding="utf-8").splitlines()]
    assert len(kls) == 4 and all(k > 0 for k in kls)
    assert f"KL to the reference (base): {sum(kls) / 4:.4f} nats per answer (mean over 4 answers" in printed
    # The adapter against itself: nothing moved.
    assert _eval(workspace, tiny_model_dir, "--reward", "length", "--adapter", str(adapter), "--kl-reference",
                 str(adapter)) == 0
    assert "KL to the reference" in (printed := capsys.readouterr().out) and ": 0.0000 nats per answer" in printed
    # Without a reference the line and the column are absent.
    assert _eval(workspace, tiny_model_dir, "--reward", "length", "--output", str(out_file)) == 0
    assert "KL to the reference" not in capsys.readouterr().out
    assert all("kl" not in json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines())
