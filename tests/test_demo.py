"""The README's main job (``python -m dtensor_ring demo``) at a tiny size, through the command line
and the launcher: 2 ranks, 3 steps, compiled per block (FSDP2 over the 2 cp ranks), with no warning
and no ``nan`` on the progress line before the first step's loss, and 4 ranks as ``--dp 2``
data-parallel groups of 2 cp ranks, eager. Its parity figures must be within the demo's own
tolerances (fp32 rounding: ``demo.LOSS_TOLERANCE`` / ``demo.GRAD_TOLERANCE``), and the same figures
for a broken model (RoPE on local positions) must fail them.
"""
import math

import pytest
import torch

from dtensor_ring.__main__ import main
from dtensor_ring.tools import demo
from dist_utils import run_on_ranks


def _parity_row(out, schedule):
    rows = [line.split() for line in out.splitlines() if line.startswith(schedule)]
    assert len(rows) == 1, out
    loss, single_loss, loss_gap, grad_gap = map(float, rows[0][1:5])
    assert loss == pytest.approx(single_loss, rel=demo.LOSS_TOLERANCE), rows
    assert 0 <= loss_gap <= demo.LOSS_TOLERANCE and 0 <= grad_gap <= demo.GRAD_TOLERANCE, rows
    assert " ".join(rows[0][7:]).startswith("ok"), rows


def test_demo_command_trains_compiled_and_matches_one_process(capfd):
    assert main(["demo", "--nproc", "2", "--steps", "3", "--schedule", "zigzag", "--batch", "1",
                 "--seq", "64"]) == 0
    out, err = capfd.readouterr()  # the ranks' output too (rank 0 draws the progress line)
    assert "compiling" in err and "nan" not in err and "Warning" not in out + err, err
    assert "dp=1 x cp=2" in out and "FSDP2, torch.compile per block" in out, out
    _parity_row(out, "zigzag")


def test_demo_command_with_data_parallel_matches_one_process(capsys):
    assert main(["demo", "--nproc", "4", "--dp", "2", "--steps", "3", "--schedule", "stripe",
                 "--batch", "2", "--seq", "64", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "dp=2 x cp=2" in out and "FSDP2, eager" in out, out
    _parity_row(out, "stripe")


def _broken_model_fails(mesh):
    row = demo.train_schedule(mesh, "zigzag", steps=2, batch=1, seq=64, compile_model=False,
                              device=torch.device("cpu"), style_options=dict(position_ids=None))
    if mesh.get_local_rank() == 0:  # the rank that compares (the gradients are the same on all)
        assert row["grad_gap"] > 100 * demo.GRAD_TOLERANCE, row
        assert demo.verdict(row).startswith("MISMATCH"), row
    else:
        assert math.isnan(row["single_loss"]) and math.isfinite(row["loss"]), row


def test_demo_check_fails_for_a_model_on_local_positions():
    run_on_ranks(2, _broken_model_fails)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(device="tpu"), "device='tpu'"),
    (dict(steps=1), "steps=1"),
    (dict(seq=62), "seq=62"),
    (dict(batch=0), "batch=0"),
    (dict(schedules=("ringg",)), "ringg"),
    (dict(dp=3), "dp=3 must divide nproc=2"),
    (dict(dp=2, batch=1), "batch=1 must be divisible by dp=2"),
    (dict(dp=0), "dp=0"),
])
def test_demo_rejects_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        demo.run_demo(**{"nproc": 2, **kwargs})
