"""The checks to run first when a CUDA GPU is lent: each kernel path against its reference, the MoE
layer without host syncs, bf16 training runs with compile and selective checkpointing, and
checkpoints saved and restored through the trainer.

    python scripts/gpu_check.py          # on a machine with one CUDA GPU: every check (minutes)
    python scripts/gpu_check.py --table  # then the side-by-side runs as a table (10 more minutes)
    python scripts/gpu_check.py --cpu    # what a CPU can run of them, at tiny sizes (CI runs this)

One line per check, PASS / FAIL / SKIP with its figures; exit status 1 if any failed. Multi-rank
NCCL paths need several GPUs and are not checked here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from trainer.observe.memory_snapshot import side_stream_bytes  # noqa: E402

# Per device, the fused SDPA kernels the models may get.
SDPA_BACKENDS = {
    "cpu": [SDPBackend.FLASH_ATTENTION],
    "cuda": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.CUDNN_ATTENTION],
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the fp64 reference
MFU_BAR = 0.45  # llama3_1b in bf16 on one H100
# of the weights' bytes the allocator may hold for other streams than the compute one
SIDE_STREAM_BAR = 0.25


def attention_inputs(device, dtype, seq=256, heads=8, kv_heads=2, head_dim=64, value_dim=None):
    """q, k, v; values `value_dim` wide (None: head_dim) for MLA's narrower values."""
    g = torch.Generator().manual_seed(0)
    shapes = [(2, heads, seq, head_dim), (2, kv_heads, seq, head_dim),
              (2, kv_heads, seq, value_dim or head_dim)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def reference_attention(q, k, v, causal: bool, mask=None):
    """fp64 math attention (grouped-query heads repeated): the output and the input gradients of
    out.sum()."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(groups, 1)
    return out, torch.autograd.grad(out.sum(), (q, k, v))


def max_error(result, reference) -> float:
    """The largest difference over the output and the gradients, each relative to its tensor's
    largest value."""
    out, grads = result
    ref_out, ref_grads = reference
    return max(((a.double() - b).abs().max() / b.abs().max()).item()
               for a, b in zip((out, *grads), (ref_out, *ref_grads)))


def check_sdpa_kernels(device, args) -> tuple[str, str]:
    """Every fused SDPA kernel of the device, fp32 and bf16, causal and not, grouped-query heads."""
    failed, figures = [], []
    for backend in SDPA_BACKENDS[device.type]:
        for dtype in (torch.float32, torch.bfloat16):
            for causal in (True, False):
                q, k, v = attention_inputs(device, dtype)
                case = f"{backend.name.lower()} {str(dtype)[6:]} {'causal' if causal else 'full'}"
                try:
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             enable_gqa=True)
                        grads = torch.autograd.grad(out.sum(), (q, k, v))
                # this kernel does not take the case: say so, not a failure
                except RuntimeError as e:
                    figures.append(f"{case}: unsupported ({str(e).splitlines()[0][:60]})")
                    continue
                error = max_error((out, grads), reference_attention(q, k, v, causal))
                figures.append(f"{case}: {error:.1e}")
                if error > TOLERANCE[dtype]:
                    failed.append(case)
    return ("FAIL" if failed else "PASS"), "; ".join(figures)


def check_attention_kernels(device, args) -> tuple[str, str]:
    """Each kernel trainer.models.attention picks on this device, and its math reference, as the
    differentiable attention (a block kernel's forward and its backward from the final log-sum-exp),
    fp32 and bf16, grouped-query, causal and within documents, values as wide as keys and narrower
    (MLA's 192-wide keys, 128-wide values; zero-padded for the kernels that want one width); and a
    masked block's row that sees no key gets no weight."""
    from trainer.models import attention as kernels

    seq = 256
    index = torch.arange(seq, device=device)
    # Documents of 37 tokens in the first sequence, of 61 in the second.
    starts = torch.stack([index - index % 37, index - index % 61])
    failed, figures, saved = [], [], kernels.KERNELS
    names = sorted(set(saved.get(device.type, {}).values()) | {"math"})
    try:
        for name in names:
            kernels.KERNELS = {device.type: {case: name for case in saved.get(device.type, {})}}
            for dtype, documents, narrow in itertools.product((torch.float32, torch.bfloat16),
                                                              (False, True), (False, True)):
                widths = {"head_dim": 192, "value_dim": 128} if narrow else {}
                q, k, v = attention_inputs(device, dtype, seq=seq, **widths)
                mask = kernels.Mask(index, index, starts) if documents else None
                case = (f"{name} {str(dtype)[6:]} {'documents' if documents else 'causal'}"
                        f"{' narrow' if narrow else ''}")
                try:
                    out = kernels.attention(q, k, v, causal=not documents, mask=mask)
                    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
                except Exception as e:  # one case that breaks fails, the others still run
                    figures.append(f"{case}: {type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[-1][:120]}")
                    failed.append(case)
                    continue
                dense = mask.dense()[:, None] if documents else None
                error = max_error((out, grads), reference_attention(q, k, v, not documents, dense))
                figures.append(f"{case}: {error:.1e}")
                if not error <= TOLERANCE[dtype]:
                    failed.append(case)
        kernels.KERNELS = saved
        # A ring block from an earlier document: the first query's document starts after every key.
        q, k, v = (x.detach() for x in attention_inputs(device, torch.bfloat16, seq=64))
        block_starts = torch.zeros(2, 64, dtype=torch.long, device=device)
        block_starts[:, 0] = 200
        out, lse = kernels.block_forward(q, k, v, False,
                                         kernels.Mask(index[:64] + 100, index[:64], block_starts))
        blind_ok = bool((out[:, :, 0] == 0).all() and (lse[:, :, 0] == float("-inf")).all()
                        and torch.isfinite(lse[:, :, 1:]).all())
        figures.append(f"masked block, row seeing no key: {'no weight' if blind_ok else 'WRONG'}")
    finally:
        kernels.KERNELS = saved
    return ("FAIL" if failed or not blind_ok else "PASS"), "; ".join(figures)


def check_moe_layer(device, args) -> tuple[str, str]:
    """The MoE layer's grouped GEMM against one matmul per expert, with host syncs as errors on
    CUDA."""
    from trainer.models.moe import MoE, _expert_swiglu_loop

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = MoE(dim=256, ffn_dim=512, n_experts=8, top_k=2)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer.to(device, dtype)
    x = torch.randn(4, 128, 256, device=device, dtype=dtype, requires_grad=True)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait raises
    try:
        out = layer(x)
        out.float().square().sum().backward()
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    tokens = torch.randn(300, 256, device=device, dtype=dtype)
    counts = torch.tensor([0, 50, 7, 100, 0, 43, 60, 40], device=device)
    experts = layer.experts
    grouped = experts(tokens, counts)
    looped = _expert_swiglu_loop(tokens, counts, experts.w1, experts.w2, experts.w3)
    largest = looped.float().abs().max().item()
    error = (grouped.float() - looped.float()).abs().max().item() / largest
    syncs = ("no host sync (set_sync_debug_mode error)" if device.type == "cuda"
             else "syncs counted by tests/test_moe.py")
    ok = error < TOLERANCE[dtype] and x.grad is not None and torch.isfinite(x.grad).all()
    said = f"{str(dtype)[6:]}: grouped vs looped rel. {error:.1e}; {syncs}"
    return ("PASS" if ok else "FAIL"), said


def check_muon(device, args) -> tuple[str, str]:
    """Muon's Newton-Schulz iteration in its dtype there (bfloat16 on CUDA): the singular values of
    a batch of feed-forward-shaped matrices land in the band, and the rate it runs at (the plan's
    optimizer term assumes the matmuls' efficiency)."""
    from trainer.optim.muon import ns_dtype, orthogonalize
    from trainer.optim.muon_exchange import ns_flops

    dtype = ns_dtype("auto", device)
    batch, rows, cols = (8, 4096, 14336) if device.type == "cuda" else (2, 128, 384)
    x = torch.randn(batch, rows, cols, device=device)
    orthogonalize(x, 5, dtype)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = orthogonalize(x, 5, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    singular = torch.linalg.svdvals(out[0].double().cpu())
    ok = 0.6 <= singular.min().item() and singular.max().item() <= 1.25
    tflops = batch * ns_flops(rows, cols, 5) / seconds / 1e12
    band = f"singular values {singular.min():.2f}-{singular.max():.2f}"
    said = (f"{str(dtype)[6:]} {batch} x {rows} x {cols}: {1e3 * seconds:.1f} ms, "
            f"{tflops:.1f} TFLOPs; {band}")
    return ("PASS" if ok else "FAIL"), said


def check_health_clock(device, args) -> tuple[str, str]:
    """The straggler check's clocks over twelve steps of matmuls, in a one-rank gloo group: on CUDA,
    events read without a host sync, the exchanges' included (one raises), the forward-backward
    figure within 20% of the same matmuls timed around a synchronize."""
    import torch.distributed as dist

    from trainer.observe.health import RankHealth

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cuda = device.type == "cuda"
    size, repeats = (8192, 8) if cuda else (256, 4)
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    health = RankHealth(every=6, window=6, threshold=1.2, device=device, stage=0, group=None,
                        log=print)
    try:
        for step in range(1, 13):
            if cuda:  # any host sync raises, the exchanges' included
                torch.cuda.set_sync_debug_mode("error")
            health.start_step(step)
            health.before_forward(step)
            for _ in range(repeats):
                y = x @ x
            health.after_backward(step)
            health.before_optimizer_step(step, torch.zeros((), device=device), 1)
            y.mul_(0.5)
            health.after_step(step)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        dist.destroy_process_group()
    if cuda:
        torch.cuda.synchronize()
    figures = health.own_figures()
    start = time.perf_counter()
    for _ in range(repeats):
        y = x @ x
    if cuda:
        torch.cuda.synchronize()
    timed = time.perf_counter() - start
    ratio = figures[1] / timed
    ok = health.ratio == 1.0 and (0.8 <= ratio <= 1.2 if cuda else figures[1] > 0)
    return ("PASS" if ok else "FAIL"), (f"{'CUDA events' if cuda else 'CPU time'}: "
                                        f"forward-backward {figures[1] * 1e3:.2f} ms a step "
                                        f"against {timed * 1e3:.2f} ms timed; "
                                        f"{'no host sync; ' if cuda else ''}exchange "
                                        f"{health.exchange_ms:.2f} ms")


TRAIN = str(REPO / "train.py")  # the script the runs start (--train)


def train(overrides: list[str], out: str) -> list[dict]:
    """One trainer run in a process of its own; its metrics.jsonl records."""
    result = subprocess.run([sys.executable, TRAIN, f"output_dir={out}", "metrics.log_every=1",
                             *overrides], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(" | ".join(result.stderr.strip().splitlines()[-4:]) or "train.py failed")
    (Path(out) / "console.log").write_text(result.stdout)
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def median_mfu(records: list[dict], warmup: int) -> float | None:
    steady = records[warmup:] or records
    return statistics.median(r["mfu"] for r in steady) if steady[0]["mfu"] is not None else None


def run_figures(records: list[dict], warmup: int) -> str:
    steady, mfu = records[warmup:] or records, median_mfu(records, warmup)
    return (f"{statistics.median(r['tokens_per_s'] for r in steady):,.0f} tokens/s, "
            f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, peak "
            f"{max(r['mem_gib'] for r in steady):.1f} GiB, loss {records[0]['loss']:.3f} -> "
            f"{records[-1]['loss']:.3f}")


def training_overrides(device, model: list[str]) -> list[str]:
    if device.type == "cuda":
        return [*model, "device=cuda", "training.steps=20",
                "training.mixed_precision.param_dtype=bfloat16", "training.compile=true",
                "training.activation_checkpoint=selective", "training.warmup_steps=5"]
    return [*model, "+smoke=cpu", "training.steps=4", "training.seq_len=64",
            "training.global_batch_size=2", "training.activation_checkpoint=selective"]


def check_llama_run(device, args) -> tuple[str, str]:
    model = (["model=llama3_1b", "training.seq_len=4096", "training.global_batch_size=4"]
             if device.type == "cuda"
             else ["model=llama_debug"])
    snapshot = ["metrics.memory_snapshot_step=3"] if device.type == "cuda" else []
    with tempfile.TemporaryDirectory() as out:
        records = train(training_overrides(device, model) + snapshot, out)
        snapshot_file = Path(out) / "memory" / "rank_0.pickle"
        side = side_stream_bytes(pickle.loads(snapshot_file.read_bytes())) if snapshot else 0
    figures = run_figures(records, warmup=5)
    if device.type != "cuda":
        return ("PASS" if records[-1]["loss"] < records[0]["loss"] else "FAIL"), figures
    mfu = median_mfu(records, warmup=5) or 0.0
    # FSDP's streams hold little of their own: the gradients come from the compute stream's pool
    # (the weights' size of it, unusable by activations, before).
    side_share = side / (records[-1]["param_mib"] * 2**20)
    return (("PASS" if mfu >= MFU_BAR and side_share <= SIDE_STREAM_BAR else "FAIL"),
            f"{figures}, side streams {side / 2**30:.2f} GiB ({side_share:.2f} of the weights) "
            f"(bars: MFU >= {100 * MFU_BAR:.0f}%, side streams <= {SIDE_STREAM_BAR})")


def check_mixtral_run(device, args) -> tuple[str, str]:
    model = ["model=mixtral_debug"]
    if device.type == "cuda":  # enlarged: 8 experts of a 1B-class block
        model += ["model.dim=1024", "model.n_heads=16", "model.n_kv_heads=8", "model.ffn_dim=2048",
                  "model.n_layers=8", "model.max_seq_len=4096", "training.seq_len=4096",
                  "training.global_batch_size=4"]
    with tempfile.TemporaryDirectory() as out:
        records = train(training_overrides(device, model), out)
    ok = all(r["loss"] == r["loss"] for r in records) and records[-1]["loss"] < records[0]["loss"]
    return ("PASS" if ok else "FAIL"), run_figures(records, warmup=5)


def check_deepseek_run(device, args) -> tuple[str, str]:
    """MLA (values narrower than keys) and dense-then-MoE blocks: DeepSeek-V2-Lite's layers (4 of
    them: one dense, three of 64 experts) on the GPU, the debug model on the CPU."""
    model = (["model=deepseek_v2_lite", "model.n_layers=4", "training.seq_len=4096",
              "training.global_batch_size=4"]
             if device.type == "cuda" else ["model=deepseek_v3_debug"])
    with tempfile.TemporaryDirectory() as out:
        records = train(training_overrides(device, model), out)
    ok = all(r["loss"] == r["loss"] for r in records) and records[-1]["loss"] < records[0]["loss"]
    return ("PASS" if ok else "FAIL"), run_figures(records, warmup=5)


def check_checkpoint_resume(device, args) -> tuple[str, str]:
    """Async saves at steps 2 and 4; the step-4 one removed, a second run restores step 2 (the DCP
    load onto the device) and must log the first run's steps 3 and 4 exactly."""
    overrides = ["model=llama_debug", "+smoke=cpu", f"device={device.type}", "training.steps=4",
                 "training.seq_len=64", "training.global_batch_size=2",
                 "training.mixed_precision.param_dtype=float32", "checkpoint.enabled=true",
                 "checkpoint.async_save=true", "checkpoint.interval=2"]
    with tempfile.TemporaryDirectory() as out:
        first = train(overrides, out)
        shutil.rmtree(Path(out) / "checkpoints" / "step_4")
        resumed = train(overrides, out)[2:]  # metrics.jsonl keeps the rows up to the resumed step
    losses = [r["loss"] for r in first[2:]], [r["loss"] for r in resumed]
    ok = losses[0] == losses[1] and [r["step"] for r in resumed] == [3, 4]
    said = f"steps 3-4: first run {losses[0]}, resumed from step 2 {losses[1]}"
    return ("PASS" if ok else "FAIL"), said


# The runs of the side-by-side table (bf16, one GPU; torchtitan's figures come from ../peers/gpu's
# kit on the same shapes): the Llama 3.2 1B shape untied (1.50B parameters), 4 x 4096 tokens, and
# Llama 3 8B's layers (8 of them), 1 x 8192 tokens. Median of the steps after the first 10 of 30.
ONE_B = ["model=llama3_1b", "model.tie_embeddings=false", "training.seq_len=4096",
         "training.global_batch_size=4"]
EIGHT_B = ["model=llama3_8b", "model.n_layers=8", "training.seq_len=8192",
           "training.global_batch_size=1"]
FLOAT8 = ["training.float8.enabled=true"]  # tensorwise, torchtitan's float8 rows
TABLE = {
    "1B shape, compile, no AC": (ONE_B, True, "none", []),
    "1B shape, compile, selective AC": (ONE_B, True, "selective", []),
    "1B shape, compile, full AC": (ONE_B, True, "full", []),
    "1B shape, eager, no AC": (ONE_B, False, "none", []),
    "8B layers, 1 x 8192, compile, selective AC": (EIGHT_B, True, "selective", []),
    "1B shape, compile, selective AC, float8 tensorwise": (ONE_B, True, "selective", FLOAT8),
    "1B shape, compile, selective AC, float8 rowwise": (ONE_B, True, "selective",
                                                        [*FLOAT8,
                                                         "training.float8.recipe=rowwise"]),
    "8B layers, 1 x 8192, compile, selective AC, float8 "
    "tensorwise": (EIGHT_B, True, "selective", FLOAT8),
}


def table_overrides(device, model: list[str], compile: bool, checkpointing: str,
                    extra: list[str]) -> list[str]:
    """One row's run. On the CPU, at tiny sizes and without compile (the code path, not the
    figures): rows that differ only in model or compile are then the same run."""
    if device.type == "cuda":
        overrides = [*model, "device=cuda", "training.steps=30", "training.warmup_steps=5",
                     "training.mixed_precision.param_dtype=bfloat16",
                     f"training.compile={str(compile).lower()}"]
    else:
        overrides = ["model=llama_debug", "+smoke=cpu", "training.steps=3", "training.seq_len=64",
                     "training.global_batch_size=2"]
    return [*overrides, f"training.activation_checkpoint={checkpointing}", *extra]


def table_run(overrides: list[str]) -> tuple[list[dict], float | None]:
    """One run of the table: its records and the plan's predicted peak of tensors (GiB)."""
    with tempfile.TemporaryDirectory() as out:
        records = train(overrides, out)
        planned = re.search(r"plan: predicted peak ([\d.]+) GiB",
                            (Path(out) / "console.log").read_text())
    return records, float(planned.group(1)) if planned else None


def workers(device) -> int:
    """One GPU runs one check or row at a time (its figures are the GPU's alone); the CPU's tiny
    runs go side by side, a core each."""
    return 1 if device.type == "cuda" else max(1, min(4, os.cpu_count() or 1))


def print_table(device) -> None:
    print("| run | tokens/s | MFU | peak reserved GiB | peak tensors GiB | plan's tensors GiB |")
    print("|---|---|---|---|---|---|")
    overrides = {name: table_overrides(device, *row) for name, row in TABLE.items()}
    with ThreadPoolExecutor(workers(device)) as pool:
        # each distinct run once
        runs = {tuple(o): pool.submit(table_run, o) for o in overrides.values()}
        for name, o in overrides.items():
            print_row(name, runs[tuple(o)])


def print_row(name: str, run: Future) -> None:
    try:
        records, planned = run.result()
    except Exception as e:  # a run that fails is a row that says so; the others still run
        print(f"| {name} | failed: {type(e).__name__}: {e} | | | | |", flush=True)
        return
    steady = records[10:] or records
    mfu = median_mfu(records, 10)
    print(f"| {name} | {statistics.median(r['tokens_per_s'] for r in steady):,.0f} | "
          f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
          f"{max(r['mem_gib'] for r in records):.1f} | "
          f"{max(r['mem_tensor_gib'] or 0 for r in records):.1f} | "
          f"{'n/a' if planned is None else f'{planned:.1f}'} |", flush=True)


RUNS = [check_deepseek_run, check_llama_run, check_mixtral_run, check_checkpoint_resume]
CHECKS = [check_sdpa_kernels, check_attention_kernels, check_moe_layer, check_muon,
          check_health_clock, *RUNS]


def main() -> None:
    global TRAIN
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true",
                        help="run the CPU-runnable checks even with a GPU present")
    parser.add_argument("--table", action="store_true",
                        help="then the side-by-side runs, as a table")
    parser.add_argument("--train", default=TRAIN,
                        help="the train.py the runs start (the tests give a stand-in)")
    args = parser.parse_args()
    TRAIN = args.train
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | one GPU: NCCL "
              "paths not checked")
    else:
        print("no GPU: the CUDA checks are skipped; the CPU-runnable ones run at tiny sizes | "
              f"torch {torch.__version__}")
    failed = 0
    with ThreadPoolExecutor(workers(device)) as pool:
        # training in processes of their own
        runs = {check: pool.submit(check, device, args) for check in RUNS}
        for check in CHECKS:
            try:
                status, detail = runs[check].result() if check in runs else check(device, args)
            except Exception as e:  # a check that crashes is a failed check; the others still run
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
            failed += status == "FAIL"
            print(f"{status} {check.__name__[len('check_'):]}: {detail}", flush=True)
    print(f"{len(CHECKS) - failed} of {len(CHECKS)} checks passed")
    if args.table:
        print_table(device)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
