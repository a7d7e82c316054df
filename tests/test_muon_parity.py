"""Muon's rows of the parity matrix: every layout reproduces the one-process Muon curve.

Each weight matrix is orthogonalised whole wherever FSDP, tensor parallel or expert parallel put its
pieces; orthogonalising each rank's piece on its own instead changes the update, and the curve moves
far beyond these tolerances (measured once by breaking it on purpose: see the README's Muon
section). The same runs, settings and tolerances as tests/test_parity.py's AdamW rows.
"""

import pytest
from helpers import train_metrics
from test_parity import (
    CHUNKED,
    COMMON,
    GRAD_NORM_RTOL,
    MOE_COMMON,
    MOE_GRAD_NORM_RTOL,
    MOE_RTOL,
    PLAIN,
    RTOL,
    check_against,
)

MUON = ("optim=muon",)
# The MoE rows hold the momentum and AdamW's moments in bfloat16 (optim.state_dtype), rounded as one
# process rounds them wherever FSDP puts a matrix's rows.
MOE_MUON = (*MUON, "optim.state_dtype=bfloat16")
# name -> (ranks, recipe and overrides, whether it is the MoE model); Mixtral's experts under expert
# parallel are each whole on their rank, orthogonalised there.
LAYOUTS = {
    "fsdp2": (2, ["+recipe=llama_fsdp"], False),
    "hsdp2x2": (4, ["+recipe=llama_hsdp"], False),
    "tp2": (2, ["+recipe=llama_tp2"], False),  # sequence and loss parallel (the recipe's)
    "tp2_fsdp2": (4, ["+recipe=llama_tp2", "parallel.dp_shard=2"], False),
    "pp2": (2, ["+recipe=llama_fsdp", "parallel.pp=2"], False),
    "ep2": (2, ["+recipe=mixtral_ep"], True),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return train_metrics(1, "+recipe=llama_fsdp", *COMMON, *MUON, *PLAIN,
                         output_dir=tmp_path_factory.mktemp("muon_reference"))


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory) -> list[dict]:
    return train_metrics(1, "+recipe=mixtral_ep", *MOE_COMMON, *MOE_MUON, *PLAIN,
                         output_dir=tmp_path_factory.mktemp("muon_moe_reference"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_layout_matches_single_process(layout, request, tmp_path):
    ranks, overrides, moe = LAYOUTS[layout]
    common = MOE_COMMON if moe else COMMON
    records = train_metrics(ranks, *overrides, *common, *(MOE_MUON if moe else MUON), *CHUNKED,
                            output_dir=tmp_path)
    reference = request.getfixturevalue("moe_reference" if moe else "reference")
    tolerances = (MOE_RTOL, MOE_GRAD_NORM_RTOL) if moe else (RTOL, GRAD_NORM_RTOL)
    check_against(reference, records, f"muon {layout}", *tolerances)
