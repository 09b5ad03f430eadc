"""LoRA export: an adapter checkpoint written merged into the weights (a plain HF model) or as a PEFT
adapter directory that `peft` loads onto the HF base; both give the adapted model's logits."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from aligner import checkpointing  # noqa: E402
from aligner.hf import export_hf, import_hf  # noqa: E402
from aligner.models import lora  # noqa: E402
from aligner.models.forward import forward_logits  # noqa: E402

from .test_hf_layout import hf_config  # noqa: E402

TOKENS = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(3))
TOLERANCE = 1e-5


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def adapter_checkpoint(request, tmp_path_factory):
    """An HF model imported as the base, adapters on every target (random B, as after training) saved on their
    own, and the adapted model's logits."""
    from aligner.hf.convert import _build_model
    from aligner.models.gpt import GPTConfig
    from aligner.runtime import distributed

    arch = request.param
    root = tmp_path_factory.mktemp(f"lora_export_{arch}")
    torch.manual_seed(0)
    hf_model = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "gpt2": "GPT2LMHeadModel"}[arch])(hf_config(arch))
    hf_model.save_pretrained(root / "hf")
    base = import_hf(root / "hf", root / "base")
    distributed.initialize(distributed.ParallelConfig())
    try:
        cfg = GPTConfig.from_dict(checkpointing.read_meta(base)["model"])
        model = _build_model(cfg)
        checkpointing.load(base, [model])
        settings = lora.PEFTConfig(scheme="lora", rank=4, alpha=8.0)
        lora.apply_lora([model], settings, seed=1)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for module in lora.adapter_modules([model]):
                module.lora_b.copy_(0.05 * torch.randn(module.lora_b.shape, generator=generator))
        adapted = forward_logits([model], TOKENS, cfg.vocab_size)
        with lora.adapters_disabled([model]):
            assert (forward_logits([model], TOKENS, cfg.vocab_size) - adapted).abs().max() > 1e-2
        checkpointing.save(root / "adapters", [model], model_config=cfg.to_dict(),
                           extra_meta={"peft": lora.checkpoint_meta(settings, base)})
    finally:
        distributed.shutdown()
    return arch, root, base, adapted


def test_merged_export_is_a_plain_hf_model_with_the_adapted_logits(adapter_checkpoint):
    arch, root, _, adapted = adapter_checkpoint
    export_hf(root / "adapters", root / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged").eval()
    assert not any("lora" in name for name in merged.state_dict())
    assert float((_hf_logits(merged) - adapted).abs().max()) < TOLERANCE


def test_peft_export_loads_onto_the_hf_base_with_the_adapted_logits(adapter_checkpoint):
    arch, root, _, adapted = adapter_checkpoint
    export_hf(root / "adapters", root / "peft", lora="peft")
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    assert float((_hf_logits(base) - adapted).abs().max()) > 1e-2  # the base alone is another function
    with_adapters = peft.PeftModel.from_pretrained(base, root / "peft").eval()
    assert float((_hf_logits(with_adapters) - adapted).abs().max()) < TOLERANCE
    expected_modules = 4 * 2 if arch == "gpt2" else 7 * 2  # per layer: qkv, proj, fc1, fc2 as HF splits them
    assert sum(1 for name in with_adapters.state_dict() if "lora_A" in name) == expected_modules


def test_peft_export_loads_with_auto_peft_alone_with_the_merged_exports_logits(adapter_checkpoint, tmp_path):
    """AutoPeftModelForCausalLM.from_pretrained(export): adapter_config.json names the base written beside the
    adapters (the base checkpoint as an HF model), from any working directory; --base-model names another."""
    arch, root, _, adapted = adapter_checkpoint
    export_hf(root / "adapters", tmp_path / "peft", lora="peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "peft" / "base").resolve())
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft").eval()
    export_hf(root / "adapters", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    auto_logits, merged_logits = _hf_logits(auto), _hf_logits(merged)
    print(f"\n[{arch}] AutoPeft vs merged: max |difference| {(auto_logits - merged_logits).abs().max():.1e}, "
          f"max |logit| {merged_logits.abs().max():.2f}")
    assert float((auto_logits - merged_logits).abs().max()) < TOLERANCE
    assert float((auto_logits - adapted).abs().max()) < TOLERANCE
    # the base written there is the base checkpoint itself: the logits of the HF model it was imported from
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "peft" / "base").eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    assert torch.equal(_hf_logits(base), _hf_logits(original))

    export_hf(root / "adapters", tmp_path / "named", lora="peft", base_model=str(root / "hf"))
    assert not (tmp_path / "named" / "base").exists()
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        root / "hf")
    named = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "named").eval()
    assert float((_hf_logits(named) - adapted).abs().max()) < TOLERANCE


def test_the_cli_exports_adapters_and_errors_name_the_problem(adapter_checkpoint, tmp_path):
    from aligner.hf.__main__ import main
    from aligner.runtime.errors import ConfigError

    arch, root, base, _ = adapter_checkpoint
    if arch != "llama":
        pytest.skip("the options and errors do not depend on the architecture")
    main(["export", "--checkpoint", str(root / "adapters"), "--output", str(tmp_path / "cli"), "--lora", "peft",
          "--base", str(base)])
    assert (tmp_path / "cli" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "cli" / "model.safetensors").exists()
    with pytest.raises(ConfigError, match="is a whole model, not LoRA adapters"):
        export_hf(base, tmp_path / "a", lora="peft")
    with pytest.raises(ConfigError, match=r"^--base-model names the HF base of a PEFT adapter export: it needs --lora"):
        export_hf(root / "adapters", tmp_path / "d", base_model=str(root / "hf"))
    with pytest.raises(ConfigError, match=rf"^--base-model {base} is not a Hugging Face model directory"):
        export_hf(root / "adapters", tmp_path / "e", lora="peft", base_model=str(base))
    with pytest.raises(ConfigError, match="pass its new place with --base"):
        export_hf(root / "adapters", tmp_path / "b", base=tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="is not the model"):
        export_hf(root / "adapters", tmp_path / "c", base=_impostor(base, tmp_path))


def _impostor(base, tmp_path):
    """A checkpoint of the same architecture that is not the base (other contents, so another manifest)."""
    import shutil

    other = tmp_path / "impostor"
    shutil.copytree(base, other)
    meta = other / checkpointing.META_FILE
    meta.write_text(meta.read_text().replace("{", '{"note": "another model",', 1))
    (other / checkpointing.MANIFEST_FILE).write_text(json.dumps(checkpointing.build_manifest(other)))
    return other
