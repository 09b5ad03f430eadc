"""SmolLM2-135M-Instruct on the GPU: the imported checkpoint's logits equal transformers' on the same
dequantised weights, both in fp32 on the GPU (`make test-gpu`; skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from ..gguf_files import aligner_logits
from ..real_model.conftest import smollm2_checkpoint, smollm2_gguf, smollm2_reference  # noqa: F401 (fixtures)
from ..real_model.test_smollm2 import CONVERSATIONS, LOGIT_TOLERANCE

pytestmark = [pytest.mark.gpu, pytest.mark.real_model,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_import_logits_on_the_gpu_match_transformers_on_the_gpu(smollm2_checkpoint, smollm2_reference):  # noqa: F811
    _, hf_tokenizer, hf_model, _ = smollm2_reference
    prompts = [hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
               for messages in CONVERSATIONS]
    length = min(map(len, prompts))
    tokens = torch.tensor([prompt[:length] for prompt in prompts])
    with torch.no_grad():
        expected = hf_model.cuda()(tokens.cuda()).logits.cpu()
    hf_model.cpu()
    logits = aligner_logits(smollm2_checkpoint, tokens)
    difference = (logits - expected).abs().max().item()
    print(f"\n[gpu] max |logit difference| {difference:.2e}, max |logit| {expected.abs().max().item():.1f}")
    assert difference < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
