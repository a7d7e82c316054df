"""peft's adapter directory in and a LoRA checkpoint merged out, held to the base the adapters
were trained on: adapters that do not fit a base are refused on import, and a --base other than
the one they record is refused unless --force (then said)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from test_hf import hf_model

from trainer.checkpoint.folders import CheckpointError
from trainer.checkpoint.hf import config_from_hf
from trainer.checkpoint.peft_io import PEFT_CONFIG, PEFT_WEIGHTS, export_merged, import_peft


def peft_adapter(folder, base, dim: int = 64, rank: int = 4) -> None:
    """A peft LoRA adapter directory: q_proj and v_proj of both blocks of a `dim`-wide Llama."""
    folder.mkdir()
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            out = dim if proj == "q_proj" else dim // 2  # 2 of 4 heads hold keys and values
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, dim)
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank)
    save_file(tensors, folder / PEFT_WEIGHTS)
    (folder / PEFT_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 8, "base_model_name_or_path": str(base),
        "target_modules": ["q_proj", "v_proj"]}))


def test_an_adapter_is_held_to_its_base_on_import_and_merge(tmp_path, capsys):
    hf_model("llama", tmp_path / "base")
    hf_model("llama", tmp_path / "copy")  # another base of the same shape
    peft_adapter(tmp_path / "adapter", tmp_path / "base")
    # adapters of a 32-wide model onto the 64-wide base: refused, naming a layer
    peft_adapter(tmp_path / "narrow", tmp_path / "base", dim=32)
    with pytest.raises(CheckpointError, match=r"narrow's adapters do not fit the base .*base: "
                       r"layers.0.attention.wq is 64 -> 64 there, the adapter's 32 -> 32 \(rank "
                       r"4\); name its base"):
        import_peft(tmp_path / "narrow", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # another base than the adapter's own, present here: refused, or taken with --force and said
    with pytest.raises(CheckpointError, match=r"--base .*copy is not the base .*adapter was "
                       r"trained on \(.*base\): its adapters would be applied to other weights"):
        import_peft(tmp_path / "adapter", tmp_path / "out", base=str(tmp_path / "copy"))
    assert import_peft(tmp_path / "adapter", tmp_path / "forced", str(tmp_path / "copy"),
                       force=True) == 4
    assert "warning: --base" in capsys.readouterr().err
    assert import_peft(tmp_path / "adapter", tmp_path / "ours") == 4
    cfg = config_from_hf(tmp_path / "base")
    with pytest.raises(CheckpointError, match="is not the base .*ours was trained on"):
        export_merged(tmp_path / "ours", cfg, tmp_path / "merged", str(tmp_path / "copy"))
    export_merged(tmp_path / "ours", cfg, tmp_path / "merged", str(tmp_path / "copy"),
                  torch.float32, force=True)
    assert "--force: using it anyway" in capsys.readouterr().err
    assert (tmp_path / "merged" / "config.json").is_file()
