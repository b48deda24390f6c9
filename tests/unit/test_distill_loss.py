"""Distillation's pure pieces against hand-computed numbers: the generalized JSD, its keys, the teacher checks."""

from __future__ import annotations

import math

import pytest
import torch

from alignkit.config import ModelArguments
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.stages.distill import DistillArguments, check_same_tokenizer, generalized_jsd, teacher_model_arguments

# One token, two-word vocabulary: p_student = [1/2, 1/2] (logits [0, 0]), p_teacher = [1/5, 4/5] (logits [0, ln 4]).
STUDENT, TEACHER = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, math.log(4.0)]])


def test_beta_0_is_the_forward_kl_teacher_to_student():
    """KL(p_t || p_s) = 0.2 ln(0.2 / 0.5) + 0.8 ln(0.8 / 0.5) = -0.183258 + 0.376003 = 0.192745."""
    assert generalized_jsd(STUDENT, TEACHER, 0.0).item() == pytest.approx(0.192745, abs=1e-6)


def test_beta_1_is_the_reverse_kl_student_to_teacher():
    """KL(p_s || p_t) = 0.5 ln(0.5 / 0.2) + 0.5 ln(0.5 / 0.8) = 0.458145 - 0.235002 = 0.223144."""
    assert generalized_jsd(STUDENT, TEACHER, 1.0).item() == pytest.approx(0.223144, abs=1e-6)


def test_beta_half_is_the_jsd_of_the_even_mixture():
    """m = 0.5 p_s + 0.5 p_t = [0.35, 0.65].
    KL(p_t || m) = 0.2 ln(0.2 / 0.35) + 0.8 ln(0.8 / 0.65) = -0.111923 + 0.166111 = 0.054188;
    KL(p_s || m) = 0.5 ln(0.5 / 0.35) + 0.5 ln(0.5 / 0.65) = 0.178337 - 0.131182 = 0.047155;
    JSD = 0.5 x 0.054188 + 0.5 x 0.047155 = 0.050672. Symmetric in the two models at beta 0.5."""
    assert generalized_jsd(STUDENT, TEACHER, 0.5).item() == pytest.approx(0.050672, abs=1e-6)
    assert generalized_jsd(TEACHER, STUDENT, 0.5).item() == pytest.approx(0.050672, abs=1e-6)


def test_beta_weights_the_mixture_towards_the_teacher():
    """beta 0.25: m = 0.75 p_s + 0.25 p_t = [0.425, 0.575].
    KL(p_t || m) = 0.2 ln(0.2 / 0.425) + 0.8 ln(0.8 / 0.575) = -0.150754 + 0.264193 = 0.113439;
    KL(p_s || m) = 0.5 ln(0.5 / 0.425) + 0.5 ln(0.5 / 0.575) = 0.081259 - 0.069881 = 0.011378;
    0.25 x 0.113439 + 0.75 x 0.011378 = 0.028360 + 0.008534 = 0.036894."""
    assert generalized_jsd(STUDENT, TEACHER, 0.25).item() == pytest.approx(0.036894, abs=1e-6)


def test_temperature_divides_both_logits_and_equal_models_give_zero():
    """T = 2 on teacher logits [0, ln 16] is the teacher [0, ln 4] at T = 1; the student [0, 0] is unchanged."""
    sharper = torch.tensor([[0.0, math.log(16.0)]])
    for beta in (0.0, 0.5, 1.0):
        assert generalized_jsd(STUDENT, sharper, beta, temperature=2.0).item() == pytest.approx(
            generalized_jsd(STUDENT, TEACHER, beta).item(), abs=1e-6)
        logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(beta.__hash__()))
        assert generalized_jsd(logits, logits, beta).abs().max().item() < 1e-6
    assert generalized_jsd(torch.zeros(2, 5, 11), torch.zeros(2, 5, 11), 0.5).shape == (2, 5)


def _autograd_jsd(student, teacher, beta, temperature):
    """The divergence as the plain autograd formula (TRL 1.16's `generalized_jsd_loss` per token, before reduction)."""
    log_ps = torch.log_softmax(student / temperature, -1)
    log_pt = torch.log_softmax(teacher / temperature, -1)
    if beta == 0.0:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_ps + math.log(1 - beta), log_pt + math.log(beta)]), 0)
    return beta * (log_pt.exp() * (log_pt - log_m)).sum(-1) + (1 - beta) * (log_ps.exp() * (log_ps - log_m)).sum(-1)


@pytest.mark.parametrize("chunk_elements", [7 * 11, 1 << 19])  # chunks of 7 rows (a short last one), and one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_hand_written_gradient_equals_autograd(monkeypatch, beta, temperature, chunk_elements):
    """`_GeneralizedJSD`'s values, gradient (with a per-token weight, as the loss's token mask gives) and entropy
    equal the autograd formula's in float64 over 3 x 5 tokens of an 11-word vocabulary, and torch's gradcheck
    agrees; no gradient reaches the teacher."""
    import alignkit.model.logprobs as logprobs
    import alignkit.stages.distill as distill

    monkeypatch.setattr(logprobs, "ELEMENTWISE_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(int(beta * 100 + temperature * 10))
    student = torch.randn(3, 5, 11, dtype=torch.float64, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 5, 11, dtype=torch.float64, generator=generator)
    weights = torch.rand(3, 5, dtype=torch.float64, generator=generator)

    ours, entropy = distill.jsd_and_entropy(student, teacher, beta, temperature)
    (ours * weights).sum().backward()
    grad_ours, student.grad = student.grad, None
    reference = _autograd_jsd(student, teacher, beta, temperature)
    (reference * weights).sum().backward()
    torch.testing.assert_close(ours, reference.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(grad_ours, student.grad, atol=1e-12, rtol=0)
    assert student.grad.abs().max() > 1e-3  # a gradient worth comparing
    probs = torch.softmax(student.detach() / temperature, -1)
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum(-1), atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda s: distill.generalized_jsd(s, teacher, beta, temperature),
                                    (student.detach().requires_grad_(),))


def test_bf16_logits_get_fp32_maths_and_a_bf16_gradient():
    """bf16 logits (a bf16 run's output layer): the divergence is computed in fp32 from them, equal to the fp32
    formula on the same (bf16-rounded) numbers, and the gradient comes back in the logits' own dtype."""
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(4, 9, generator=generator).to(torch.bfloat16).requires_grad_()
    teacher = torch.randn(4, 9, generator=generator).to(torch.bfloat16)
    out = generalized_jsd(student, teacher, 0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _autograd_jsd(student.float(), teacher.float(), 0.5, 1.0).detach(),
                               atol=1e-6, rtol=0)
    out.sum().backward()
    assert student.grad.dtype == torch.bfloat16


def test_keys_have_trl_defaults_and_beta_is_checked():
    args = DistillArguments()
    assert (args.beta, args.max_completion_length, args.temperature, args.top_p, args.top_k) == (1.0, 512, 1.0, 1.0, 0)
    with pytest.raises(ConfigError, match=r"beta=1.5 must be in \[0, 1\]"):
        DistillArguments(beta=1.5)
    config = parse_config({"stage": "distill", "teacher_adapter_name_or_path": "sft", "beta": 0.5})
    assert config.method.beta == 0.5 and config.method.teacher_adapter_name_or_path == "sft"


def test_a_teacher_is_required_and_defaults_to_the_students_base():
    with pytest.raises(ConfigError, match="stage distill needs a teacher"):
        parse_config({"stage": "distill"})
    student = ModelArguments(model_name_or_path="base", adapter_name_or_path="old")
    teacher = teacher_model_arguments(student, DistillArguments(teacher_adapter_name_or_path="sft"))
    assert (teacher.model_name_or_path, teacher.adapter_name_or_path) == ("base", "sft")


class _Tokenizer:
    def __init__(self, vocab, eos="<eos>"):
        self.vocab, self.eos_token, self.bos_token, self.pad_token, self.unk_token = vocab, eos, None, eos, None

    def get_vocab(self):
        return dict(self.vocab)


def test_another_tokenizer_is_refused_naming_the_difference():
    student = _Tokenizer({"a": 0, "b": 1, "<eos>": 2})
    check_same_tokenizer(student, _Tokenizer({"a": 0, "b": 1, "<eos>": 2}), "t")  # the same: accepted
    with pytest.raises(ConfigError, match="4 tokens against the student's 3"):
        check_same_tokenizer(student, _Tokenizer({"a": 0, "b": 1, "<eos>": 2, "c": 3}), "t")
    with pytest.raises(ConfigError, match="token 'a' is id 0 for the student, 1 for it"):
        check_same_tokenizer(student, _Tokenizer({"a": 1, "b": 0, "<eos>": 2}), "t")
    with pytest.raises(ConfigError, match="eos_token 'b'"):
        check_same_tokenizer(student, _Tokenizer({"a": 0, "b": 1, "<eos>": 2}, eos="b"), "t")
