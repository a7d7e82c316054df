"""FLOPs per token, device peaks and the console line."""

import pytest
import torch

from trainer import build_model
from trainer.hardware import cuda_peak_tflops
from trainer.models import model_config as load_model_config
from trainer.observe.metrics import flops_per_token, format_record, peak_tflops
from trainer.observe.summary import duration, summary_lines


def test_flops_per_token_is_six_times_the_matmul_weights_plus_attention():
    cfg = load_model_config("llama_debug")
    model = build_model(cfg, device="meta")
    matmul_weights = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2
                         and "tok_embeddings" not in n)
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
    line = format_record({"step": 3, "loss": 2.5, "grad_norm": 1.25, "lr": 3e-4,
                          "tokens_per_s": 12345.6, "mfu": 0.123, "mem_gib": 0.5, "elapsed_s": 4.2})
    assert line == ("step     3 | loss 2.5000 | grad_norm 1.250 | lr 3.00e-04 | 12,346 tok/s | mfu "
                    "12.3% | mem 0.50 GiB | 4.2s")


def test_the_console_line_ends_with_the_time_left():
    line = format_record({"step": 3, "loss": 2.5, "grad_norm": 1.25, "lr": 3e-4,
                          "tokens_per_s": 1.0, "mfu": None, "mem_gib": 0.5, "elapsed_s": 4.2,
                          "eta_s": 3725.0})
    assert line.endswith(" | 4.2s | 1h02m left")
    assert [duration(s) for s in (0.4, 59, 65, 3599, 7260)] == ["0s", "59s", "1m05s", "59m59s",
                                                                "2h01m"]


def test_the_summary_says_what_was_trained_kept_and_how_to_go_on(tmp_path):
    saved = [(2, tmp_path / "step_2"), (4, tmp_path / "step_4")]
    lines = summary_lines(3, 4, 10, 1000, 75.0, [(900.0, 0.4), (1100.0, 0.5), (1000.0, 0.45)],
                          [1.5, 2.25, 2.0], 1, saved)
    assert (lines[0]
            == "summary: trained steps 3-4 (2 steps, 2,000 tokens) in 1m15s: median 1,000 tok/s, "
               "MFU 45.0%")
    assert (lines[1]
            == "summary: peak memory 1.50-2.25 GiB a rank (rank 1 the most); 1 optimizer step(s) "
               "skipped")
    assert lines[2] == (f"summary: checkpoints step_2, step_4 in {tmp_path}; to train on from step "
                        "4: rerun the same command; to export: python scripts/convert_hf.py to-hf "
                        f"{tmp_path}/step_4 OUT_DIR")
    finished = summary_lines(1, 10, 10, 1000, 9.0, [], [1.0], 0, None)
    assert finished[1] == "summary: peak memory 1.00 GiB; 0 optimizer step(s) skipped"
    assert finished[2].startswith("summary: no checkpoint written (checkpoint.enabled=false)")


def test_cuda_peaks_go_by_the_exact_device_name():
    assert cuda_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert cuda_peak_tflops("NVIDIA H100 NVL") == 835.0
    assert cuda_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert cuda_peak_tflops("NVIDIA L40") == 181.0  # not the L4's figure
    assert cuda_peak_tflops("NVIDIA L4") == 121.0
    with pytest.warns(UserWarning, match="no peak FLOP/s known for the device 'NVIDIA L20'"):
        assert cuda_peak_tflops("NVIDIA L20") is None
