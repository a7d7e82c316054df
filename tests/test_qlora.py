"""QLoRA: LoRA on a base held in 4-bit NormalFloat (torchao's NF4 tensor): the stored base is the
quantized original's round trip, it stays bit-identical while the adapters learn, the plan holds it
in 4 bits, and FSDP2 trains it exactly as one process does, resuming in another layout."""

import pytest
import torch
from helpers import NEEDS_TORCHAO, train_metrics
from test_lora import FAST, GRAD_NORM_RTOL, LORA, RTOL, lora_model
from test_parity import CHUNKED, COMMON, PLAIN, check_against, max_relative_difference

from trainer.checkpoint import save_weights
from trainer.checks.job import check_job
from trainer.checks.overrides import compose_job
from trainer.errors import ConfigError
from trainer.models import build_model, family, init_weights, materialize
from trainer.models.lora import LoraOptions, add_adapters
from trainer.models.nf4 import NF4_BYTES, quantize, quantize_base, stored_bytes
from trainer.optim.build import build_optimizer
from trainer.plan import make_plan
from trainer.plan.devices import local_device

pytestmark = NEEDS_TORCHAO
QLORA = (*LORA, "peft.base_dtype=nf4")


def qlora_model():
    model = build_model("llama_debug", device="meta")
    spec = family("llama")
    names = add_adapters(model, LoraOptions(8, 16.0, 0.0, spec.lora_targets, "nf4"), spec.blocks)
    quantize_base(model, torch.float32, "cpu")
    materialize(model, "cpu")
    init_weights(model, seed=0)
    return model, names


def test_the_4bit_base_is_the_originals_round_trip_and_stays_while_the_adapters_learn():
    model, names = qlora_model()
    plain, _ = lora_model()
    for name in names:
        held, original = model.get_submodule(name).weight, plain.get_submodule(name).weight
        round_trip = quantize(original.detach()).get_original_weight()
        assert torch.equal(held.get_original_weight(), round_trip), name
        error = (round_trip - original).norm() / original.norm()
        assert 0 < error < 0.15, (name, error)  # 4 bits: close, not equal
        assert stored_bytes(held) / (original.numel() * 4) < 0.14  # 0.52 bytes against fp32's 4
    codes = {n: model.get_submodule(n).weight.quantized_data.clone() for n in names}
    optimizer = build_optimizer(model, compose_job(["+smoke=cpu"]).optim, 3e-3, 0.0)
    tokens = torch.randint(0, 2048, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):  # one batch again and again: the adapters alone fit it
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    for name in names:
        assert torch.equal(model.get_submodule(name).weight.quantized_data, codes[name]), name


def test_the_plan_holds_the_4bit_base_and_qlora_refuses_tensor_parallel():
    def plan(*overrides):
        job = compose_job(["+smoke=cpu", "model=llama_debug", *overrides])
        return make_plan(job, check_job(job, 1), local_device(torch.device("cpu"), 1)).ranks[0]

    lora, qlora = plan(*LORA), plan(*QLORA)
    _, names = lora_model()
    model = build_model("llama_debug", device="meta")
    quantized = sum(model.get_submodule(n).weight.numel() for n in names)
    assert qlora.params == pytest.approx(lora.params - quantized * (4 - NF4_BYTES))
    assert qlora.grads == lora.grads and qlora.optimizer == lora.optimizer
    job = compose_job(["+smoke=cpu", "model=llama_debug", *QLORA, "parallel.tp=2"])
    with pytest.raises(ConfigError, match="peft.base_dtype=nf4 does not combine with "
                                          "parallel.tp=2"):
        check_job(job, 2)


@pytest.mark.multiprocess
def test_qlora_fsdp2_matches_single_process_from_a_checkpoint_and_resumes_in_one(tmp_path):
    """From a seed checkpoint (each 4-bit weight read whole and quantized whole, each rank keeping
    its rows): fsdp2 follows one process's curve; its halfway checkpoint (the adapters) resumes in
    one process and follows it on."""
    seed = tmp_path / "seed"
    save_weights(build_model("llama_debug", seed=3).config,
                 build_model("llama_debug", seed=3).state_dict(), seed)
    half = int(next(o for o in COMMON if o.startswith("training.steps=")).split("=")[1]) // 2
    start = (*COMMON, *QLORA, *FAST, f"checkpoint.initial={seed}")
    saving = ("checkpoint.enabled=true", f"checkpoint.interval={half}", "checkpoint.keep_last=0")
    reference = train_metrics(1, "+recipe=llama_fsdp", *start, *PLAIN, output_dir=tmp_path / "one")
    records = train_metrics(2, "+recipe=llama_fsdp", *start, *CHUNKED, *saving,
                            output_dir=tmp_path / "fsdp2")
    check_against(reference, records, "qlora fsdp2", RTOL, GRAD_NORM_RTOL)
    saved = tmp_path / "fsdp2" / "checkpoints" / f"step_{half}"
    resumed = train_metrics(1, "+recipe=llama_fsdp", *start, *CHUNKED, *saving,
                            f"checkpoint.resume={saved}", output_dir=tmp_path / "resumed")
    losses = [r["loss"] for r in resumed]
    assert max_relative_difference(losses, [r["loss"] for r in records[half:]]) <= RTOL
