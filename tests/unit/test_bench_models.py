"""The benchmarks' arithmetic and plumbing that needs no timing: `ratio` lines, the decode-step floor,
and `--model` resolution (both sides must hold the same weights), and a run on contended CPUs flagged."""
from __future__ import annotations

import pytest
import torch

from aligner.runtime import cpu_pressure
from benchmarks.generation import (
    BatchResult,
    alternated,
    decode_step_bytes,
    decode_step_flops,
    load_sides,
    logit_tolerance,
    make_prompts,
    report,
)
from benchmarks.machine import MachineRates
from benchmarks.run_bench import Benchmark, parse_ratios, ratio_line, run

from ..chat_tokenizers import build_chat_tokenizer


def test_ratio_lines_are_read_back_and_other_lines_ignored():
    output = "\n".join([
        "batch 8",
        "  decode step   HF generate 1.15 ms  native 1.10 ms  HF / native 1.05x",
        ratio_line("generation_b8_vs_hf", 0.9137),
        "ratio with spaces in the name 1.0",
        "  ratio generation_b8_vs_hf 2.0",  # indented: not a ratio line
        ratio_line("sft_step_vs_trl", 12.5),
        "ratio overflow inf",
        "ratio tiny 1e-3",
    ])
    assert parse_ratios(output) == [("generation_b8_vs_hf", 0.914), ("sft_step_vs_trl", 12.5),
                                    ("overflow", float("inf")), ("tiny", 1e-3)]
    with pytest.raises(ValueError, match="no spaces"):
        ratio_line("two words", 1.0)


SPINNING_BENCHMARK = """
import os, subprocess, sys, time
spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * os.cpu_count())]
time.sleep(2.5)
for spinner in spinners:
    spinner.kill()
    spinner.wait()
print("ratio spun 1.0")
"""


@pytest.mark.skipif(not cpu_pressure.SYSTEM_PRESSURE.is_file(), reason="the kernel has no CPU pressure file (PSI)")
def test_a_benchmark_run_on_contended_cpus_is_flagged(tmp_path):
    """A benchmark whose run oversubscribes the CPUs (twice as many spinning processes as CPUs) has its
    CPU pressure measured over its run and flagged in the summary line."""
    script = tmp_path / "spin.py"
    script.write_text(SPINNING_BENCHMARK)
    outcome = run(Benchmark("spin", str(script)), threads=1)
    assert outcome.exit_code == 0 and outcome.ratios == [("spun", 1.0)]
    assert outcome.contended is not None and outcome.contended > cpu_pressure.CONTENDED_SHARE, outcome
    assert "(flag: other work contended for the CPUs" in outcome.describe()


@pytest.mark.parametrize("tied", [True, False])
def test_decode_step_flops_and_bytes_match_a_hand_count(single_process, tied):
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config

    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=96, vocab_size=128, tie_embeddings=tied, max_position_embeddings=64)
    model = build_gpt_model(cfg, transformer_config(cfg))
    batch, context = 3, 10
    # Per layer (head dim 16): q 64x64, k and v 64x32 each, o 64x64; gated MLP 2 x 64x96 and 96x64.
    per_layer_macs = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 * 96 + 96 * 64
    attention_macs = 2 * 4 * 16 * context  # q.K over the context, then p.V, per head
    output_macs = 64 * 128
    assert decode_step_flops(cfg, batch, context) == 2 * batch * (2 * (per_layer_macs + attention_macs) + output_macs)
    # Read once per step: every layer's weights and two norms, the final norm, and the 128 x 64 output matrix
    # (tied: the embedding, read whole by the output layer; untied: only looked-up rows of the embedding).
    weights = 2 * (per_layer_macs + 2 * 64) + 64 + 128 * 64
    kv_cache = 2 * 2 * batch * 2 * 16 * context  # K and V, layers, rows, groups, head dim, columns
    assert decode_step_bytes(model, cfg, batch, context) == 4 * (weights + kv_cache)


def test_report_states_the_larger_floor_over_the_native_step():
    machine = MachineRates(matmul_flops=100e9, read_bytes=10e9, load=0.0)
    result = BatchResult(batch=8, hf_tokens_per_s=100.0, native_tokens_per_s=120.0, tokens_ratio=1.2, hf_step=0.3,
                         native_step=0.2, step_ratio=1.5, hf_prefill=0.5, native_prefill=0.4, step_flops=5e9,
                         step_bytes=1e9, matmuls=0.1, greedy_rows_equal=8)
    # compute floor 5e9 / 100e9 = 50 ms, memory floor 1e9 / 10e9 = 100 ms: memory-bound, 100 ms / 200 ms
    assert parse_ratios("\n".join(report(result, machine, machine.read_bytes))) == [
        ("generation_b8_vs_hf", 1.2), ("generation_b8_decode_vs_hf", 1.5), ("generation_b8_vs_measured_floor", 0.5)]
    faster_reads = parse_ratios("\n".join(report(result, machine, 40e9)))  # memory 25 ms: compute-bound, 50 ms
    assert faster_reads[-1] == ("generation_b8_vs_measured_floor", 0.25)


def test_an_hf_model_dir_resolves_to_a_checkpoint_and_hf_dir_with_its_logits(single_process, tmp_path):
    import transformers

    from aligner.models.forward import forward_logits
    from benchmarks.models import resolve_model

    source = tmp_path / "hf_source"
    tokenizer = build_chat_tokenizer(source, "smollm2")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                                      pad_token_id=tokenizer.pad_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():  # every tensor carries signal (not HF's init)
            param.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(param))
    reference.save_pretrained(str(source))

    cache = tmp_path / "cache"
    sides = load_sides(str(source), cache_dir=cache)
    tokens = torch.tensor(make_prompts(sides, 3, 12))
    assert tokens.shape == (3, 12) and len({tuple(row) for row in tokens.tolist()}) == 3  # distinct text windows
    with torch.no_grad():
        expected = reference(tokens).logits
        assert torch.allclose(sides.hf_model(tokens).logits, expected, atol=1e-5, rtol=0)
        assert torch.allclose(forward_logits([sides.model], tokens, sides.cfg.vocab_size), expected, atol=1e-5,
                              rtol=0)

    first = resolve_model(str(source), cache)
    stamps = {path: path.stat().st_mtime_ns for path in (first.checkpoint_dir, first.hf_dir)}
    again = resolve_model(str(source), cache)  # cached: the same directories, not converted again
    assert (again.checkpoint_dir, again.hf_dir) == (first.checkpoint_dir, first.hf_dir)
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps


def test_bf16_decode_step_bytes_are_half_of_fp32_and_its_floor_uses_the_bf16_rate(single_process):
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config

    cfg = GPTConfig.llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=96, vocab_size=128, max_position_embeddings=64)
    model = build_gpt_model(cfg, transformer_config(cfg))
    fp32, bf16 = (decode_step_bytes(model.to(dtype), cfg, 3, 10) for dtype in (torch.float32, torch.bfloat16))
    assert bf16 == fp32 / 2  # weights and KV cache (the cache takes the model's dtype)
    samples = [MachineRates(100e9, 30e9, 0.0, torch.bfloat16, 8192),
               MachineRates(300e9, 10e9, 1.0, torch.bfloat16, 8192),
               MachineRates(200e9, 20e9, 0.5, torch.bfloat16, 8192)]
    rates = MachineRates.best(samples)  # each rate's highest sample, wherever it was measured
    assert rates == MachineRates(300e9, 30e9, 1.0, torch.bfloat16, 8192)
    assert MachineRates.describe_samples(samples).endswith("matmul 100, 300, 200 GFLOP/s; read 30.0, 10.0, 20.0 GB/s; "
                                                           "load 0.00, 1.00, 0.50")
    assert "(bf16 8192^3, median)" in rates.describe()
    assert "(fp32 1024^3, median)" in MachineRates(1e9, 1e9, 0.0).describe()  # the CPU default, as before


def test_logit_tolerance_is_unchanged_in_fp32_and_relative_to_the_logit_scale_in_bf16():
    assert logit_tolerance(torch.float32, 10.0) == pytest.approx(2e-4)
    assert logit_tolerance(torch.bfloat16, 20.0) == pytest.approx(1.0)


def test_alternated_reverses_the_order_every_other_round_and_reports_in_run_order():
    calls = []
    runs = [lambda name=name: calls.append(name) for name in "abc"]
    rounds = alternated(runs, repeats=3, device=torch.device("cpu"))
    assert calls == list("abccbaabc")
    assert len(rounds) == 3 and all(len(seconds) == 3 and min(seconds) >= 0 for seconds in rounds)


def test_compare_graphs_report_adds_gpu_decode_ratios_and_read_shares():
    machine = MachineRates(matmul_flops=100e12, read_bytes=2e12, load=0.0)
    result = BatchResult(batch=64, hf_tokens_per_s=100.0, native_tokens_per_s=150.0, tokens_ratio=1.5, hf_step=0.004,
                         native_step=0.002, step_ratio=2.0, hf_prefill=0.01, native_prefill=0.01, step_flops=1e9,
                         step_bytes=2e9, matmuls=0.001, greedy_rows_equal=None, graphs_tokens_per_s=300.0,
                         graphs_step=0.001, graphs_tokens_ratio=3.0, graphs_step_ratio=4.0)
    # 2 GB per step at 2 TB/s: 1 ms; HF's 4 ms step is a 25% share, eager 2 ms 50%, graphs 1 ms 100%
    assert parse_ratios("\n".join(report(result, machine, machine.read_bytes)))[3:] == [
        ("gpu_decode_eager_vs_hf_b64", 2.0), ("gpu_decode_graphs_vs_hf_b64", 4.0),
        ("gpu_decode_graphs_vs_eager_b64", 2.0), ("gpu_decode_hf_hbm_share_b64", 0.25),
        ("gpu_decode_eager_hbm_share_b64", 0.5), ("gpu_decode_graphs_hbm_share_b64", 1.0)]


def test_anchor_rows_divide_each_sides_decode_step_by_ours_and_compare_greedy_tokens(capsys):
    """generation_anchors.report_batch: decode = (t_N - t_1) / (N - 1) per round, ratios per round against ours,
    medians; rows equal to ours counted."""
    from types import SimpleNamespace

    from benchmarks.generation_anchors import Side, report_batch

    def side(name, full_s, first_s, rows):
        return Side(name, lambda batch, new: (full_s if new > 1 else first_s, rows), {2})

    sides = [side("ours", 1.0 + 63 * 0.01, 1.0, [[1, 2], [3, 4]]),  # decode 10 ms
             side("llama.cpp", 0.5 + 63 * 0.02, 0.5, [[1, 2], [3, 5]])]  # decode 20 ms, one row differs
    report_batch(2, sides, SimpleNamespace(warmup=1, repeats=3, new_tokens=64))
    out = capsys.readouterr().out
    assert parse_ratios(out) == [("anchor_llama_cpp_b2_decode", pytest.approx(2.0, abs=1e-3))]
    assert "greedy rows equal to ours 1 of 2" in out and "decode   10.00 ms/step" in out
