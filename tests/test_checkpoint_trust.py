"""Files from elsewhere are data: a crafted checkpoint cannot run code on any path that reads one
(checkpoint.initial, a resume, the converter), and the file that would prove it ran is never
written."""

import os
import pickle
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import NEEDS_TORCHFT, REPO, launch, run_script
from omegaconf import OmegaConf
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from trainer import build_model, load_weights
from trainer.checkpoint import CheckpointError, TrainState, folders
from trainer.checkpoint.metadata import read_metadata
from trainer.config.schema import OptimConfig
from trainer.optim.build import build_optimizer

sys.path.insert(0, str(REPO / "scripts"))
import convert_hf  # noqa: E402

# The debug model's shape at its smallest: a checkpoint of it is a few hundred KiB.
TINY = {"family": "llama", "name": "tiny", "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2,
        "vocab_size": 256, "ffn_dim": 64}


class Payload:
    """Unpickled, it writes `marker`: the proof that a checkpoint ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def dotted_name(marker) -> bytes:
    """A pickle naming os.system through a module the old allow-list took by its prefix: protocol
    4 resolves the dotted name `os.system` inside torch.distributed.checkpoint.filesystem."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()  # SHORT_BINUNICODE

    return (b"\x80\x04" + text("torch.distributed.checkpoint.filesystem") + text("os.system")
            + b"\x93" + text(f"touch {marker}") + b"\x85R.")  # STACK_GLOBAL, TUPLE1, REDUCE, STOP


def training_checkpoint(folder, step: int = 2) -> None:
    """A one-process training checkpoint of TINY (model, optimizer, step), published."""
    model = build_model(TINY)
    optimizer = build_optimizer(model, OptimConfig(), 1e-3, 0.0)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    model(tokens, labels=tokens).backward()
    optimizer.step()
    tmp = folder.with_name(folder.name + ".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(TrainState([model], optimizer).for_save(step, 0), checkpoint_id=tmp, no_dist=True)
    OmegaConf.save(OmegaConf.structured(model.config), tmp / folders.MODEL_CONFIG)
    folders.publish(tmp, folder, step, 0, 1)


def republish(folder) -> None:
    """The manifest recomputed, as anyone can: a crafted checkpoint passes the damage check."""
    (folder / folders.MANIFEST).unlink()
    tmp = folder.with_name(folder.name + ".tmp")
    folder.rename(tmp)
    folders.publish(tmp, folder, 2, 0, 1)


def craft(folder, how: str, marker) -> None:
    """Makes checkpoint `folder` run `touch marker` when read: `bytes` (an entry DCP would
    torch.load with weights_only=False), `dotted` (a dotted name in the metadata's pickle) or
    `reduce` (a pickled object whose reduction is os.system)."""
    metadata_file = folder / ".metadata"
    if how == "bytes":
        metadata = pickle.loads(metadata_file.read_bytes())
        for key in ("trainer.step", next(k for k in metadata.state_dict_metadata
                                         if k.startswith("model."))):
            metadata.state_dict_metadata[key] = BytesStorageMetadata()
            for index in [i for i in metadata.storage_data if i.fqn == key]:
                del metadata.storage_data[index]
            payload = pickle.dumps(Payload(marker))
            metadata.storage_data[MetadataIndex(key)] = _StorageInfo("payload.bin", 0,
                                                                     len(payload))
        (folder / "payload.bin").write_bytes(payload)
        metadata_file.write_bytes(pickle.dumps(metadata))
    else:
        metadata_file.write_bytes(dotted_name(marker) if how == "dotted"
                                  else pickle.dumps(Payload(marker)))
    republish(folder)


CRAFTS = ["bytes", "dotted", "reduce"]


@pytest.mark.parametrize("how", CRAFTS)
def test_a_crafted_checkpoint_runs_nothing_as_initial_weights_or_on_resume(tmp_path, how):
    marker = tmp_path / "ran"
    training_checkpoint(tmp_path / "step_2")
    craft(tmp_path / "step_2", how, marker)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'step_2'}"):
        load_weights(build_model(TINY), tmp_path / "step_2")  # checkpoint.initial's path
    model = build_model(TINY)
    state = TrainState([model], build_optimizer(model, OptimConfig(), 1e-3, 0.0))
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'step_2'}"):
        state.load(tmp_path / "step_2")  # a resume's
    with pytest.raises(CheckpointError):
        convert_hf.to_hf(tmp_path / "step_2", tmp_path / "hf", None, "float32", "5GB")
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()


def test_what_is_refused_is_named(tmp_path):
    training_checkpoint(tmp_path / "step_2")
    craft(tmp_path / "step_2", "bytes", tmp_path / "ran")
    refused = "refused, nothing of it loaded: entry '.*' is declared as BytesStorageMetadata"
    with pytest.raises(CheckpointError, match=refused):
        read_metadata(tmp_path / "step_2")
    (tmp_path / "step_2" / ".metadata").write_bytes(dotted_name(tmp_path / "ran"))
    with pytest.raises(CheckpointError, match="filesystem.os.system does not belong"):
        read_metadata(tmp_path / "step_2")


def test_an_entry_stored_outside_its_folder_is_refused(tmp_path):
    training_checkpoint(tmp_path / "step_2")
    metadata = pickle.loads((tmp_path / "step_2" / ".metadata").read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
    (tmp_path / "step_2" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not a file of the folder"):
        read_metadata(tmp_path / "step_2")


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", CRAFTS)
def test_train_and_the_converter_refuse_a_crafted_checkpoint_with_one_line(tmp_path, how):
    """Under train.py, as checkpoint.initial and as the newest checkpoint of a rerun, and under
    scripts/convert_hf.py: one `config error:` line (the converter's: `error:`), exit 2, and the
    payload never ran."""
    marker = tmp_path / "ran"
    crafted = tmp_path / "run" / "checkpoints" / "step_2"
    crafted.parent.mkdir(parents=True)
    training_checkpoint(crafted)
    craft(crafted, how, marker)
    common = ("model=llama_debug", *(f"model.{k}={v}" for k, v in TINY.items()
                                     if k not in ("family", "name")),
              "+smoke=cpu", "training.steps=3")
    initial = launch(1, *common, f"checkpoint.initial={crafted}", output_dir=tmp_path / "a")
    # a rerun's newest checkpoint: the crafted one, in its output_dir
    rerun = launch(1, *common, "checkpoint.enabled=true", output_dir=tmp_path / "run")
    converted = run_script(REPO / "scripts" / "convert_hf.py", "to-hf", crafted, tmp_path / "hf")
    for result in (initial, rerun, converted):
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and str(crafted) in errors[0], result.stderr[-2000:]
    assert not marker.exists()


@NEEDS_TORCHFT
def test_a_recovering_replica_group_loads_a_peers_state_as_data_only(tmp_path):
    """Fault tolerance's transfer: served on the address towards the lighthouse (loopback here)
    under a token, and a reply that pickles an object is refused, its code never run."""
    from datetime import timedelta
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from threading import Thread

    from trainer.faults.ft_transport import _stream_save, listen_address, safe_transport

    assert listen_address("http://localhost:29510") in ("127.0.0.1", "::1")
    timeout = timedelta(seconds=10)
    sender, receiver = safe_transport("http://127.0.0.1:29510", timeout), None
    try:
        state = {"params": [torch.arange(6.0)], "trainer": {"step": 3, "data_offset": 12}}
        sender.send_checkpoint([1], 3, state, timeout)
        assert sender.metadata().startswith("http://127.0.0.1:")
        receiver = safe_transport("http://127.0.0.1:29510", timeout)
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, timeout)
        assert torch.equal(got["params"][0], state["params"][0]) and got["trainer"]["step"] == 3
        guessed = sender.metadata().rsplit("/", 2)[0] + "/not-the-token/"
        with pytest.raises(OSError, match="404"):
            receiver.recv_checkpoint(0, guessed, 3, timedelta(seconds=2))
        sender.disallow_checkpoint()
    finally:
        for transport in (sender, receiver):
            if transport is not None:
                transport.shutdown()

    marker = tmp_path / "ran"

    class Hostile(BaseHTTPRequestHandler):  # a "peer" whose state is a pickled payload
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            _stream_save({"params": [Payload(marker)]}, self.wfile)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hostile)
    Thread(target=server.serve_forever, daemon=True).start()
    receiver = safe_transport("http://127.0.0.1:29510", timeout)
    try:
        with pytest.raises(pickle.UnpicklingError, match="unsupported GLOBAL posix.system"):
            receiver.recv_checkpoint(0, f"http://127.0.0.1:{server.server_address[1]}/t/", 3,
                                     timeout)
    finally:
        receiver.shutdown()
        server.shutdown()
    assert not marker.exists()
