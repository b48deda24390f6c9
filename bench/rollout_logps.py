"""Time and peak memory of scoring rollouts: `alignkit.rl.rollout.completion_logps` on the bundled model.

    python bench/rollout_logps.py --groups 2 --completion-length 256 --grad --bf16
    PYTHONPATH=/tmp/wt_old python bench/rollout_logps.py ...   # another checkout's alignkit, for an A/B

GRPO's scoring of one micro-batch: `--groups` prompts (a chat-template user turn, about 40 tokens each) with
`--generations` completions each, of random token ids and random lengths up to `--completion-length` (`--full`:
every completion that long), the model with LoRA adapters (rank 8, every linear layer) at random, at temperature
0.9 with entropies as in a training step. `--grad` runs forward + backward of a loss over the log-probs (the
policy's pass in `compute_loss`); without it, one forward under `no_grad` (the reference's and the old policy's).
`--bf16` runs under a CPU bf16 autocast. Prints one JSON line: the tokens in the batch, the median wall seconds of
`--reps` repetitions after one warm-up, and the process's peak RSS (run one configuration per process for a
clean peak). Run alone on the machine. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--full", action="store_true", help="every completion --completion-length tokens long")
    parser.add_argument("--grad", action="store_true", help="forward + backward (default: forward, no grad)")
    parser.add_argument("--bf16", action="store_true", help="under a CPU bf16 autocast")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import alignkit
    from alignkit.model.bundled import bundled_model_dir
    from alignkit.rl.rollout import completion_logps

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = bundled_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0,
                                             init_lora_weights=False))
    model.train(args.grad)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {7 * i + 3} plus {11 * i + 5}? "
                                                                         "Explain."}],
                                             tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
               for i in range(args.groups)]
    rows, width = args.groups * args.generations, max(map(len, prompts))
    prompt_ids = torch.full((rows, width), tokenizer.pad_token_id)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row in range(rows):
        ids = prompts[row // args.generations]
        prompt_ids[row, width - len(ids):] = torch.tensor(ids)
        prompt_mask[row, width - len(ids):] = 1
    length = args.completion_length
    completion_ids = torch.randint(100, 20000, (rows, length))
    lengths = torch.full((rows,), length) if args.full else torch.randint(length // 3, length + 1, (rows,))
    completion_mask = (torch.arange(length)[None] < lengths[:, None]).long()

    def score() -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16), torch.set_grad_enabled(args.grad):
            logps, _ = completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                        temperature=0.9, with_entropy=args.grad)
            if args.grad:
                (logps * completion_mask).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    score()
    times = [score() for _ in range(args.reps)]
    print(json.dumps({"alignkit": os.path.dirname(os.path.dirname(alignkit.__file__)),
                      "tokens": int(prompt_mask.sum() + completion_mask.sum()), "grad": args.grad, "bf16": args.bf16,
                      "seconds": round(statistics.median(times), 3),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))


if __name__ == "__main__":
    main()
