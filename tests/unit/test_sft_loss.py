"""The SFT loss against a float64 reference, and what the model builder promises."""
from __future__ import annotations

import pytest
import torch

from aligner.models import lora as lora_module
from aligner.models.gpt import GPTConfig, build_gpt_model, num_parameters, padded_vocab_size, transformer_config

pytestmark = pytest.mark.usefixtures("single_process")


def test_response_token_loss_matches_float64_reference():
    from aligner.algorithms.sft import response_token_loss

    generator = torch.Generator().manual_seed(0)
    vocab, padded = 50, 64
    logits = torch.randn(3, 7, padded, generator=generator) * 3
    labels = torch.randint(0, vocab, (3, 7), generator=generator)
    loss_mask = (torch.rand(3, 7, generator=generator) > 0.4).float()
    loss_sum, num_tokens = response_token_loss(logits, labels, loss_mask, vocab)

    # Reference: log-softmax over the real vocabulary only, in float64.
    log_probs = torch.log_softmax(logits[..., :vocab].double(), dim=-1)
    nll = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    expected = (nll * loss_mask.double()).sum()
    assert int(num_tokens) == int(loss_mask.sum())
    assert float(loss_sum) == pytest.approx(float(expected), rel=1e-6)
    # Padding rows must not take probability mass: with them the loss would be larger.
    with_padding = -(torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                     * loss_mask).sum()
    assert float(with_padding) > float(expected) + 1e-3


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_parameter_count_matches_the_built_model(style):
    cfg = getattr(GPTConfig, style)(num_layers=2, hidden_size=64, num_attention_heads=4,
                                    num_query_groups=2 if style == "llama" else None, ffn_hidden_size=96,
                                    vocab_size=128,
                                    make_vocab_size_divisible_by=128, max_position_embeddings=32)
    model = build_gpt_model(cfg, transformer_config(cfg))
    built = sum(p.numel() for p in model.parameters())
    assert num_parameters(cfg) == built


def test_vocab_padding_is_layout_independent():
    assert padded_vocab_size(100, 128, 1) == padded_vocab_size(100, 128, 2) == 128
    with pytest.raises(ValueError, match="not divisible by tensor_model_parallel_size=3"):
        padded_vocab_size(100, 128, 3)


def test_config_validation_errors():
    with pytest.raises(ValueError, match="num_query_groups"):
        GPTConfig(num_attention_heads=4, num_query_groups=3, vocab_size=10).validate()
    with pytest.raises(ValueError, match="not divisible by tensor_model_parallel_size=4"):
        GPTConfig(num_attention_heads=6, num_query_groups=2, vocab_size=10).validate(4)
    with pytest.raises(ValueError, match="unknown model config keys"):
        GPTConfig.from_dict({"num_layers": 2, "hiden_size": 3})


def test_packed_sequences_give_the_same_loss_as_separate_ones():
    """Block-diagonal attention + restarted positions make a packed row equal to its parts."""
    from aligner.algorithms.sft import response_token_loss
    from aligner.data.sft import collate_sft

    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=40,
                          make_vocab_size_divisible_by=8, max_position_embeddings=64)
    model = build_gpt_model(cfg, transformer_config(cfg)).eval()
    generator = torch.Generator().manual_seed(1)
    examples = []
    for length in (5, 9, 4):
        tokens = torch.randint(4, 40, (length,), generator=generator)
        examples.append({"tokens": tokens, "loss_mask": torch.tensor([0, 0] + [1] * (length - 2))})

    def total_loss(batch):
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        loss_sum, count = response_token_loss(logits, batch["labels"], batch["loss_mask"], cfg.vocab_size)
        return float(loss_sum), int(count)

    separate = total_loss(collate_sft(examples, pad_id=0))
    packed_example = {
        "tokens": torch.cat([e["tokens"] for e in examples]),
        "loss_mask": torch.cat([e["loss_mask"] for e in examples]),
        "segment_ids": torch.cat([torch.full((len(e["tokens"]),), i) for i, e in enumerate(examples)]),
    }
    packed = total_loss(collate_sft([packed_example], pad_id=0))
    # In the packed row the first token of each later segment is a label of the previous
    # segment's last token; its loss_mask is 0 there (loss_mask starts with 0s), so counts match.
    assert packed[1] == separate[1]
    assert packed[0] == pytest.approx(separate[0], rel=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["full_weights", "lora"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_keeps_loss_and_gradients(recompute, lora):
    """Recomputed activations are the same numbers: loss and every gradient equal the stored path. With LoRA
    the embedding is frozen, so the first recomputed block's input does not require grad: its adapters must
    still get their gradients (megatron's checkpoint is torch's reentrant one, which would drop them)."""
    from aligner.algorithms.sft import response_token_loss

    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=40,
                          make_vocab_size_divisible_by=8, max_position_embeddings=64)
    stored = build_gpt_model(cfg, transformer_config(cfg))
    recomputed = build_gpt_model(cfg, transformer_config(cfg, activation_recompute=recompute))
    if lora:
        for model in (stored, recomputed):
            lora_module.apply_lora([model], lora_module.PEFTConfig(scheme="lora", rank=4), seed=1)
            for module in lora_module.adapter_modules([model]):  # B = 0 at the start: a gradient for A too
                torch.nn.init.normal_(module.lora_b, std=0.1, generator=torch.Generator().manual_seed(5))
    recomputed.load_state_dict(stored.state_dict())
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 40, (3, 12), generator=generator)
    positions = torch.arange(12).expand(3, -1)
    loss_mask = (torch.rand(3, 12, generator=generator) > 0.3).float()
    calls = []  # the attention core of the first layer: run again in backward only when recomputed
    for model in (stored, recomputed):
        model.decoder.layers[0].self_attention.core_attention.register_forward_hook(
            lambda *_, model=model: calls.append(model))
    losses = []
    for model in (stored, recomputed):
        loss, _ = response_token_loss(model(tokens, positions, None), tokens.roll(-1, 1), loss_mask, 40)
        loss.backward()
        losses.append(loss.detach())
    assert (calls.count(stored), calls.count(recomputed)) == (1, 2)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    trained = [(name, want, got) for (name, want), got in zip(stored.named_parameters(), recomputed.parameters())
               if want.requires_grad]
    assert len(trained) == (16 if lora else len(list(stored.parameters())))  # 2 layers x 4 targets x (A, B)
    for name, want, got in trained:
        assert want.grad is not None and want.grad.abs().sum() > 0, name
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-6, msg=name)
