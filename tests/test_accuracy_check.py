"""The README's main job (``python -m dtensor_ring check``) at a tiny size, through the launcher."""
import torch

from dtensor_ring.__main__ import main
from dtensor_ring.tools.accuracy_check import verdict
from dtensor_ring.tools.numerics import TOLERANCE


def test_check_job_runs_and_reports_every_rank_within_tolerance(capsys):
    assert main(["check", "--nproc", "2", "--seq", "128", "--heads", "4", "--kv-heads", "2",
                 "--schedule", "zigzag", "--schedule", "llama3", "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith(("zigzag", "llama3"))]
    assert len(rows) == 2
    for row in rows:
        limit = TOLERANCE[torch.float32]
        assert row[-2] == "ok" and all(0.5 < float(x) <= limit for x in row[2:6]), row


def test_verdict_separates_rounding_from_wrong_answers():
    assert verdict({"out": 1.05, "dv": 1.09}, torch.float32) == "ok"
    assert verdict({"out": 1.05, "dv": 1.30}, torch.bfloat16) == "high"
    assert verdict({"out": 40.0, "dv": 1.0}, torch.bfloat16) == "WRONG"
