"""Knowledge distillation's math: pure functions on logits and logprobs, nothing here touches a model.

SFT-KD (NeMo-Aligner's): at each response position the teacher's top-k tokens and logits are known
(precomputed). Both distributions are taken over those k tokens alone: the teacher's softmax of its
k logits, p, and the student's logprobs of the same k tokens renormalised among themselves, q.
The loss is KL(p || q) = sum_j p_j (log p_j - log q_j) per position: 0 when the student ranks the k
tokens as the teacher does, whatever mass it gives the rest of the vocabulary (the NLL term of the
objective covers that).
"""
from __future__ import annotations

import torch


def topk_kl(student_logprobs: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || q_student) [positions] over the teacher's top-k tokens.

    student_logprobs: [positions, k] the student's log-softmax (over the whole vocabulary) at the teacher's
    k token ids; teacher_logits: [positions, k] the teacher's logits of those ids (no gradient)."""
    if student_logprobs.shape != teacher_logits.shape:
        raise ValueError(f"student {tuple(student_logprobs.shape)} and teacher {tuple(teacher_logits.shape)} "
                         "top-k tensors differ in shape")
    teacher_logprobs = torch.log_softmax(teacher_logits.to(student_logprobs.dtype), dim=-1)
    student_restricted = student_logprobs - torch.logsumexp(student_logprobs, dim=-1, keepdim=True)
    return (teacher_logprobs.exp() * (teacher_logprobs - student_restricted)).sum(dim=-1)
