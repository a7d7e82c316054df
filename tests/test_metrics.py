"""FLOPs per token, device peaks and the console line."""

import pytest
import torch

from trainer import build_model
from trainer.hardware import cuda_peak_tflops
from trainer.metrics import flops_per_token, format_record, peak_tflops
from trainer.models import model_config as load_model_config


def test_flops_per_token_is_six_times_the_matmul_weights_plus_attention():
    cfg = load_model_config("llama_debug")
    model = build_model(cfg, device="meta")
    matmul_weights = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n)
    assert flops_per_token(cfg, 128) == 6 * matmul_weights + 12 * cfg.n_layers * cfg.dim * 128


def test_llama3_8b_flops_are_the_known_figure():
    # About 6 * 7.5e9 weights that multiply (8.0e9 minus the 0.5e9 embedding) per token.
    assert 44e9 < flops_per_token(load_model_config("llama3_8b"), 0) < 46e9


def test_cpu_peak_is_the_setting_or_measured():
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, None) is None
    assert peak_tflops(cpu, 2.5) == 2.5
    assert 0 < peak_tflops(cpu, "auto") < 100


def test_console_line_is_readable():
    line = format_record({"step": 3, "loss": 2.5, "grad_norm": 1.25, "lr": 3e-4, "tokens_per_s": 12345.6,
                          "mfu": 0.123, "mem_gib": 0.5, "elapsed_s": 4.2})
    assert line == ("step     3 | loss 2.5000 | grad_norm 1.250 | lr 3.00e-04 | 12,346 tok/s | mfu 12.3% | "
                    "mem 0.50 GiB | 4.2s")


def test_cuda_peaks_go_by_the_exact_device_name():
    assert cuda_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert cuda_peak_tflops("NVIDIA H100 NVL") == 835.0
    assert cuda_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert cuda_peak_tflops("NVIDIA L40") == 181.0  # not the L4's figure
    assert cuda_peak_tflops("NVIDIA L4") == 121.0
    with pytest.warns(UserWarning, match="no peak FLOP/s known for the device 'NVIDIA L20'"):
        assert cuda_peak_tflops("NVIDIA L20") is None
