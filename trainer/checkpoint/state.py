"""What a checkpoint holds, saved and loaded with torch.distributed.checkpoint (DCP).

The model and optimizer state are saved under the whole model's parameter names (a pipeline
stage keeps the names of the whole model), as DTensor shards that DCP reassembles for whatever
layout loads them. Only tensors are saved, and a checkpoint whose metadata declares anything else
is refused before DCP reads it (metadata.py), so loading never unpickles an object from a file.
"""

from __future__ import annotations

import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.checkpoint.folders import (
    ADAPTER_CONFIG,
    MODEL_CONFIG,
    CheckpointError,
    publish,
    rank_world,
    verify,
)
from trainer.checkpoint.hf import config_from_hf, is_hf_dir
from trainer.checkpoint.hf_import import load_hf_slices
from trainer.checkpoint.metadata import SafeReader
from trainer.checkpoint.tokenizer_files import copy_tokenizer
from trainer.config.schema import ModelConfig, shape_keys
from trainer.float8 import plain
from trainer.models import copy_full, model_config
from trainer.models.lora import has_adapters, is_adapter
from trainer.models.nf4 import is_nf4
from trainer.safe_write import check_new_output, temporary_beside
from trainer.tensors import local_tensor

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _whole_name(key: str, at: int) -> str:
    """Drops the model part's index ("0.", "1.", ...) from a key of nn.ModuleList(parts)'s state:
    the `at`-th dotted component (0 for model keys, 1 for "state.0.layers...")."""
    parts = key.split(".")
    return ".".join(parts[:at] + parts[at + 1:])


class TrainState:
    """Views of the model parts' and optimizer's state under the whole model's names, sharing
    storage with the live tensors, so DCP saves from them and loads into them in place. A LoRA
    model's state is its adapters: the frozen base is not saved (it is the initial weights)."""

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = nn.ModuleList(parts), optimizer
        self.adapted = any(has_adapters(part) for part in parts)

    def model_state(self, frozen: bool | None = None) -> tuple[dict, dict]:
        """The live state dict and its view under the whole model's names; with the frozen
        parameters (by default, unless the model has adapters)."""
        frozen = not self.adapted if frozen is None else frozen
        live = get_model_state_dict(self.model, options=_model_options(frozen))
        return live, {_whole_name(k, 0): plain(v) for k, v in live.items()}

    def optimizer_state(self) -> tuple[dict, dict]:
        # Flattened: one key per (parameter, state) pair. The param groups' hyperparameters are
        # not saved: they come from the config, and the LR schedule from the step.
        live = get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)
        return live, {_whole_name(k, 1): v for k, v in live.items() if k.startswith("state.")}

    def for_save(self, step: int, data_position: int) -> dict:
        state = {"model": self.model_state()[1], "optimizer": self.optimizer_state()[1]}
        rank, world = rank_world()
        state["trainer"] = {
            "step": torch.tensor(step),
            "data_position": torch.tensor(data_position),
            "world_size": torch.tensor(world),
        }
        state["rng"] = {f"rank{rank}": _rng_state()}
        return state

    def load(self, path: Path) -> tuple[int, int, int]:
        """Loads everything from checkpoint `path`; returns (step, data position, the world size
        that saved it)."""
        live_model, model = self.model_state()
        live_optim, optim = self.optimizer_state()
        trainer = {"step": torch.tensor(0), "data_position": torch.tensor(0),
                   "world_size": torch.tensor(0)}
        reader = SafeReader(path)
        keys = reader.read_metadata().state_dict_metadata
        if not any(k.startswith("optimizer.") for k in keys):
            raise CheckpointError(f"checkpoint.resume={path} holds weights only (a seed or "
                                  "converted checkpoint); start from it with "
                                  f"checkpoint.initial={path}")
        _dcp_load({"model": model, "optimizer": optim, "trainer": trainer}, path)
        set_model_state_dict(self.model, live_model, options=_model_options(not self.adapted))
        set_optimizer_state_dict(self.model, self.optimizer, live_optim, options=_FLAT)
        rank, world = rank_world()
        # Random state is per rank: it carries over only to the same number of ranks.
        if f"rng.rank{rank}" in keys and int(trainer["world_size"]) == world:
            rng = {f"rank{rank}": _rng_state()}
            _dcp_load({"rng": rng}, path)
            _set_rng_state(rng[f"rank{rank}"])
        return int(trainer["step"]), int(trainer["data_position"]), int(trainer["world_size"])

    def load_weights(self, path: Path) -> None:
        """The weights of checkpoint `path`; a buffer it lacks (the MoE bias of aux-loss-free
        balancing, switched on for a model converted without one) keeps its initial value, as do
        LoRA adapters (the weights are their base)."""
        if (path / ADAPTER_CONFIG).is_file():
            self.load_adapters(path)
            return
        live, model = self.model_state(frozen=True)
        saved = SafeReader(path).read_metadata().state_dict_metadata
        kept = {_whole_name(name, 0) for name, _ in self.model.named_buffers()}
        kept |= {k for k in model if is_adapter(k)}
        model = {k: v for k, v in model.items() if f"model.{k}" in saved or k not in kept}
        quantized = {k: model.pop(k) for k in list(model) if is_nf4(local_tensor(model[k]))}
        _dcp_load({"model": model}, path)
        _load_quantized(quantized, path)
        set_model_state_dict(self.model, live)

    def load_adapters(self, path: Path) -> None:
        """A LoRA checkpoint's (or an imported peft adapter's) base, then its adapters, into a
        model with the same adapters (their optimizer starts afresh)."""
        if not self.adapted:
            raise CheckpointError(f"{path} holds LoRA adapters: train on from them with "
                                  "peft.method=lora, or merge them into their base first "
                                  "(scripts/convert_hf.py --merge)")
        # (that its adapters are this model's is checked before launch: check_peft_checkpoints)
        live, model = self.model_state(frozen=False)
        recorded = OmegaConf.load(path / ADAPTER_CONFIG)
        if recorded.get("base") is None:
            raise CheckpointError(f"{path} names no base ({ADAPTER_CONFIG}: base) to train on")
        load_weights(list(self.model), recorded.base, key=f"the base of {path}")
        _dcp_load({"model": model}, path)
        set_model_state_dict(self.model, live, options=_model_options(False))


def _load_quantized(params: dict, path: Path) -> None:
    """QLoRA's 4-bit weights: each read whole (a layer's at a time), quantized, and this rank's rows
    kept, as the model's initialisation does: the same in every layout."""
    layers: dict[str, dict] = {}
    for name, param in params.items():
        layers.setdefault(".".join(name.split(".")[:2]), {})[name] = param
    for layer in layers.values():
        full = {name: torch.empty(p.shape, dtype=p.dtype, device=local_tensor(p).device)
                for name, p in layer.items()}
        _dcp_load({"model": full}, path)
        for name, param in layer.items():
            copy_full(param, full[name])


def _model_options(frozen: bool) -> StateDictOptions:
    """The model's whole state, or (a LoRA model's) its trained parameters only."""
    return StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)


def _rng_state() -> torch.Tensor:
    """This rank's CPU (and current CUDA device's) random state, as one byte tensor."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return torch.cat(states)


def _set_rng_state(state: torch.Tensor) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    if state.numel() > cpu and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[cpu:].clone())



@contextmanager
def quiet_single_process():
    """DCP warns on every call made without a process group, which is how one-process tools use
    it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore",
                                message="torch.distributed is (disabled, )?unavailable or "
                                        "uninitialized")
        yield


def _dcp_load(state: dict, path: Path) -> None:
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(path), no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    # DCP wraps each rank's failure (in a CheckpointException, a BaseException); its last line names
    # the missing key or file.
    except (Exception, dcp.CheckpointException) as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"cannot load checkpoint {path}: "
                              f"{first[-1] if first else type(e).__name__}") from None


def load_weights(model: nn.Module | list[nn.Module], path: str | Path, key: str = "path") -> None:
    """Loads weights into `model` (a plain model, or a parallelized model's parts) from a
    checkpoint of ours (any layout, weights or full training state) or a Hugging Face directory."""
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    path = Path(path)
    if is_hf_dir(path):
        check_same_shape(parts[0].config, config_from_hf(path), f"{key}={path}")
        load_hf_slices(parts, path)
        return
    problem = verify(path, *rank_world())
    if problem is not None:
        raise CheckpointError(f"{key}={path} is neither a Hugging Face directory nor a usable "
                              f"checkpoint: {problem}")
    check_same_shape(parts[0].config, saved_config(path), f"{key}={path}")
    TrainState(parts).load_weights(path)


def save_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], out: Path,
                 tokenizer: str | None = None, adapter: dict | None = None) -> None:
    """Writes full weights as a weights-only checkpoint (a seed or converted one), from one process,
    with `tokenizer`'s files (data.tokenizer's form) when given; `adapter` (the peft keys and base
    of LoRA adapters, which `weights` then are)."""
    check_new_output(out)
    tmp = temporary_beside(out, folder=True)
    try:
        OmegaConf.save(OmegaConf.structured(cfg), tmp / MODEL_CONFIG)
        if tokenizer is not None:
            copy_tokenizer(tokenizer, tmp)
        if adapter is not None:
            OmegaConf.save(OmegaConf.create(adapter), tmp / ADAPTER_CONFIG)
        with quiet_single_process():
            dcp.save({"model": weights}, checkpoint_id=tmp, no_dist=True)
        if out.exists():  # (an empty folder: check_new_output took no other)
            out.rmdir()
        publish(tmp, out, 0, 0, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone already, renamed, when all went well)


def saved_config(path: Path) -> ModelConfig | None:
    file = path / MODEL_CONFIG
    return model_config(OmegaConf.load(file)) if file.is_file() else None


def check_same_shape(ours: ModelConfig, saved: ModelConfig | None, what: str) -> None:
    """A checkpoint loads only into the same architecture (the shape keys of both configs'
    families): every difference is named at once, with the overrides that would make this model
    match it."""
    if saved is None:
        return
    differ = []
    for name in dict.fromkeys(shape_keys(saved) + shape_keys(ours)):
        a, b = getattr(saved, name, None), getattr(ours, name, None)
        if a != b and not (isinstance(a, float) and isinstance(b, float)
                           and abs(a - b) <= 1e-9 * abs(b)):
            differ.append((name, a, b))
    if differ:
        said = ", ".join(f"model.{name}={a} (this model: {b})" for name, a, b in differ)
        overrides = " ".join(f"model.{name}={'null' if a is None else a}" for name, a, _ in differ)
        raise CheckpointError(f"{what} holds a model of another shape: {said}; to train it, add "
                              f"{overrides}")


