"""HostWeights: a second model's weights swapped into live chunks and back, bit for bit."""
import pytest
import torch

from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
from aligner.models.weight_swap import HostWeights
from aligner.runtime import seeds


def _model(seed: int):
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=40, make_vocab_size_divisible_by=8, max_position_embeddings=32)
    seeds.set_seed(seed)
    return build_gpt_model(cfg, transformer_config(cfg))


def test_swap_runs_the_other_weights_and_restores_exactly(single_process):
    policy, reference = _model(1), _model(2)
    tokens = torch.randint(0, 40, (3, 7))
    positions = torch.arange(7).expand(3, -1)
    with torch.no_grad():
        expected_reference = reference(tokens, positions, None)
        expected_policy = policy(tokens, positions, None)
    stored = HostWeights.snapshot([reference])
    param_ids = [id(p) for p in policy.parameters()]
    with torch.no_grad(), stored.swapped_in([policy]):
        inside = policy(tokens, positions, None)
    with torch.no_grad():
        after = policy(tokens, positions, None)
    assert torch.equal(inside, expected_reference)
    assert torch.equal(after, expected_policy)
    assert [id(p) for p in policy.parameters()] == param_ids  # same Parameter objects (optimizer, DDP keep them)
    # The store still holds the reference weights for the next swap.
    with torch.no_grad(), stored.swapped_in([policy]):
        assert torch.equal(policy(tokens, positions, None), expected_reference)


def test_swap_back_happens_when_the_block_raises(single_process):
    policy, reference = _model(1), _model(2)
    before = [p.detach().clone() for p in policy.parameters()]
    stored = HostWeights.snapshot([reference])
    with pytest.raises(RuntimeError, match="boom"), stored.swapped_in([policy]):
        raise RuntimeError("boom")
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_other_layout_is_refused(single_process):
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=40, make_vocab_size_divisible_by=8, max_position_embeddings=32)
    other = build_gpt_model(cfg, transformer_config(cfg))
    stored = HostWeights.snapshot([other])
    with pytest.raises(ValueError, match="different model layout"):
        stored.exchange([_model(1)])


def test_on_one_memory_the_swap_exchanges_the_tensors_and_copies_nothing(single_process):
    """CPU: the stored copy lives in the model's own memory, so the parameters take the stored tensors
    themselves (no 538 MB of SmolLM2 copied each way), and the store takes the live ones."""
    policy, reference = _model(1), _model(2)
    stored = HostWeights.snapshot([reference])
    stored_pointers = [tensor.data_ptr() for tensor in stored.tensors.values()]
    live_pointers = [param.data_ptr() for param in policy.parameters()]
    with stored.swapped_in([policy]):
        assert [param.data_ptr() for param in policy.parameters()] == stored_pointers
        assert [tensor.data_ptr() for tensor in stored.tensors.values()] == live_pointers
    assert [param.data_ptr() for param in policy.parameters()] == live_pointers
    assert [tensor.data_ptr() for tensor in stored.tensors.values()] == stored_pointers
