"""`rollout.completion_logps` with shared prompts (the padding-free row with shared prefixes under per-sequence
attention; otherwise a prompt pass whose KV cache the group shares) equals the padded one-pass forward, values and
gradients."""

from __future__ import annotations

import pytest
import torch

from alignkit.rl.rollout import completion_logps


def _batch(completion_len: int):
    """Two prompts (lengths 3 and 5, left-padded with id 2) x 3 rows each, rows interleaved as a shuffled GRPO
    slice would have them, plus one prompt of its own; completions right-padded after random stop points."""
    g = torch.Generator().manual_seed(0)
    prompts = {0: [2, 2, 5, 17, 30], 1: [7, 8, 9, 10, 11], 2: [2, 40, 41, 42, 43]}
    masks = {0: [0, 0, 1, 1, 1], 1: [1, 1, 1, 1, 1], 2: [0, 1, 1, 1, 1]}
    order = [0, 1, 1, 0, 2, 1, 0]
    prompt_ids = torch.tensor([prompts[i] for i in order])
    prompt_mask = torch.tensor([masks[i] for i in order])
    completion_ids = torch.randint(3, 500, (len(order), completion_len), generator=g)
    lengths = torch.randint(1, completion_len + 1, (len(order),), generator=g)
    completion_mask = (torch.arange(completion_len) < lengths[:, None]).long()
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("layout", ["padding_free", "kv_cache"])
@pytest.mark.parametrize("completion_len", [1, 6])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_pass_equals_one_pass(lora_policy, monkeypatch, layout, completion_len, temperature):
    """Log-probs, entropies and LoRA gradients of a loss over them agree within 1e-5 (float rounding only),
    also with `batch_size` cutting a group across chunks, in both shared layouts; C = 1 takes the prompt pass alone
    in the KV-cache layout."""
    from alignkit.rl import rollout

    if layout == "kv_cache":
        monkeypatch.setattr(rollout, "uses_per_sequence_attention", lambda model: False)
    batch = _batch(completion_len)
    results = {}
    for share in (False, True):
        lora_policy.zero_grad()
        logps, entropy = completion_logps(lora_policy, *batch, temperature=temperature, with_entropy=True,
                                          share_prompts=share)
        (logps * batch[3]).sum().backward()
        grads = {n: p.grad.clone() for n, p in lora_policy.named_parameters() if p.grad is not None}
        with torch.no_grad():
            chunked, _ = completion_logps(lora_policy, *batch, temperature=temperature, batch_size=3,
                                          share_prompts=share)
        results[share] = (logps.detach(), entropy, grads, chunked)
    (a_logps, a_ent, a_grads, a_chunk), (b_logps, b_ent, b_grads, b_chunk) = results[False], results[True]
    # Positions after a completion's end are meaningless (callers mask them); the packed row does not compute them.
    mask = batch[3].bool()
    a_logps, a_ent, a_chunk = (t.masked_fill(~mask, 0) for t in (a_logps, a_ent, a_chunk))
    b_logps, b_ent, b_chunk = (t.masked_fill(~mask, 0) for t in (b_logps, b_ent, b_chunk))
    torch.testing.assert_close(b_logps, a_logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(b_ent, a_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(b_chunk, a_logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(a_chunk, a_logps, atol=1e-5, rtol=0)
    assert set(a_grads) == set(b_grads) and len(a_grads) > 0
    for name in a_grads:
        torch.testing.assert_close(b_grads[name], a_grads[name], atol=1e-5, rtol=1e-4)
    assert any(g.abs().max() > 1e-4 for g in a_grads.values())  # gradients are not trivially zero


def test_shared_prompt_pass_runs_each_prompt_once(lora_policy, record_forward_shapes):
    """7 rows over 3 distinct prompts: one padding-free row of the 3 prompts' real tokens (3 + 5 + 4) and each
    completion's real tokens, each prompt run once for its group (the completions share no first token); without
    sharing, 7 padded rows of P + C."""
    batch = _batch(6)
    assert len({(int(row[0]), tuple(p[m.bool()].tolist())) for row, p, m in zip(batch[2], batch[0], batch[1])}) == 7
    seen = record_forward_shapes(lora_policy.get_base_model())
    with torch.no_grad():
        completion_logps(lora_policy, *batch)
    assert seen == [(1, 12 + int(batch[3].sum()))]
    seen.clear()
    with torch.no_grad():
        completion_logps(lora_policy, *batch, share_prompts=False)
    assert seen == [(7, 11)]


@pytest.fixture
def lora_policy(tiny_model_dir, tmp_path, save_perturbed_adapter):
    """A trainable PeftModel with non-zero LoRA B matrices, in train mode (dropout 0 in the tiny config)."""
    model = save_perturbed_adapter(tiny_model_dir, tmp_path / "adapter")
    model.train()
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def test_eager_attention_takes_the_kv_cache_prompt_pass(lora_policy, record_forward_shapes):
    """Without per-sequence attention (eager here; flash attention alike) the prompt pass (3 distinct prompts of 5
    columns) and the completion pass on its cache (7 rows of the completions but their last token) run instead, with
    the padding-free layout's log-probs."""
    batch = _batch(6)
    config = lora_policy.get_base_model().config
    with torch.no_grad():
        packed, _ = completion_logps(lora_policy, *batch)
        config._attn_implementation = "eager"
        try:
            seen = record_forward_shapes(lora_policy.get_base_model())
            cached, _ = completion_logps(lora_policy, *batch)
        finally:
            config._attn_implementation = "sdpa"
    assert seen == [(3, 5), (7, 5)]
    mask = batch[3].bool()
    torch.testing.assert_close(cached.masked_fill(~mask, 0), packed, atol=1e-5, rtol=0)


def test_gradient_checkpointing_keeps_the_padding_free_shared_row(lora_policy, record_forward_shapes):
    """Under gradient checkpointing with gradients on, the padding-free row with shared prefixes still runs (the
    checkpointed layers' reruns attend as its forward did), with the log-probs and LoRA gradients of the run without
    checkpointing. The KV-cache pass cannot (transformers drops the cache in checkpointed layers): under eager
    attention the rows run padded (7 rows of P + C), with the same log-probs."""
    batch = _batch(6)
    base = lora_policy.get_base_model()

    def scored():
        lora_policy.zero_grad()
        logps, _ = completion_logps(lora_policy, *batch)
        (logps * batch[3]).sum().backward()
        return logps.detach().masked_fill(~batch[3].bool(), 0), {
            n: p.grad.clone() for n, p in lora_policy.named_parameters() if p.grad is not None}

    plain, plain_grads = scored()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        seen = record_forward_shapes(base)
        checkpointed, grads = scored()
        assert seen == [(1, 12 + int(batch[3].sum()))]
        seen.clear()
        base.config._attn_implementation = "eager"
        try:
            eager, _ = scored()
        finally:
            base.config._attn_implementation = "sdpa"
        assert seen == [(7, 11)]
    finally:
        base.gradient_checkpointing_disable()
    torch.testing.assert_close(checkpointed, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(eager, plain, atol=1e-5, rtol=0)
    assert set(grads) == set(plain_grads) and len(grads) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prompt_gradients_are_bit_reproducible_on_two_threads(lora_policy, monkeypatch):
    """A prompt's gradient is the sum over its group's copies. Copied by advanced indexing (`x[rows]`, as
    transformers' `batch_select_indices` does) that sum runs as `index_put_(accumulate=True)`, which on a CPU adds with
    atomics from several threads once a tensor passes 32768 elements: its order, so its last bits, changed from run to
    run (a GRPO run with tools, whose prompts carry the tool schemas, trained 1.5e-8 apart after one step). The
    copies are made with `index_select`, whose backward sums in index order: five backward passes on 2 threads give the
    same gradients bit for bit (with `x[rows]` they did not, on this 2-core machine). The prompts are 300 tokens long,
    so the prompt pass's KV cache (7 rows x 2 heads x 300 x 16 per layer) is past the grain size."""
    from alignkit.rl import rollout

    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(6)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 500, (3, 295), generator=g)
    group = {5: 0, 7: 1, 40: 2}  # each row's prompt, by its first real token
    prompt_ids = torch.cat([prefix[[group[int(row[row != 2][0])] for row in prompt_ids]], prompt_ids], dim=1)
    prompt_mask = torch.cat([torch.ones(7, 295, dtype=torch.long), prompt_mask], dim=1)
    # The prompt pass and its copied cache.
    monkeypatch.setattr(rollout, "uses_per_sequence_attention", lambda model: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(5):
            lora_policy.zero_grad()
            logps, _ = completion_logps(lora_policy, prompt_ids, prompt_mask, completion_ids, completion_mask)
            (logps * completion_mask).sum().backward()
            grads.append({n: p.grad.clone() for n, p in lora_policy.named_parameters() if p.grad is not None})
    finally:
        torch.set_num_threads(threads)
    for other in grads[1:]:
        assert [n for n in grads[0] if not torch.equal(grads[0][n], other[n])] == []


def test_completion_token_logits_padding_free_equal_padded(lora_policy):
    """`completion_token_logits` (distillation's logits): padding-free and padded give the K real completion tokens'
    logits at the mask's places, in row-major order, equal within 1e-5, with equal LoRA gradients; and they are the
    plain padded forward's logits at those places."""
    from alignkit.rl.rollout import completion_token_logits

    batch = _batch(6)
    results = {}
    for padding_free in (True, False):
        lora_policy.zero_grad()
        logits, place = completion_token_logits(lora_policy, *batch, padding_free=padding_free)
        (logits.float().logsumexp(-1).sum() + logits[:, 7].sum()).backward()
        grads = {n: p.grad.clone() for n, p in lora_policy.named_parameters() if p.grad is not None}
        results[padding_free] = (logits.detach(), place, grads)
    (a, a_place, a_grads), (b, b_place, b_grads) = results[True], results[False]
    want_rows, want_cols = batch[3].nonzero(as_tuple=True)
    for rows, cols in (a_place, b_place):
        assert torch.equal(rows, want_rows) and torch.equal(cols, want_cols)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert set(a_grads) == set(b_grads) and len(a_grads) > 0
    for name in a_grads:
        torch.testing.assert_close(a_grads[name], b_grads[name], atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the plain padded forward: column P - 1 + j predicts completion token j
        ids, mask = torch.cat(batch[:3:2], dim=1), torch.cat(batch[1::2], dim=1)
        full = lora_policy(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a, full[want_rows, batch[0].size(1) - 1 + want_cols], atol=1e-5, rtol=0)
