"""The benchmarks' command lines: every script in bench/ (but the helpers they import) answers
--help, and a bad --profile-methods name (bench/speed.py), --backends name (bench/gpu_accuracy.py) or
--parts name (bench/triton_tune.py) stops the run before any rank or sweep starts, naming the
argument, the value and the valid names."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import gpu_accuracy  # noqa: E402
import speed  # noqa: E402
import triton_tune  # noqa: E402

# imported by the benchmarks, not run
HELPERS = {"timing", "report", "kernel_kinds", "graph_capture", "per_rank_plot", "mixes"}


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS))
def test_every_benchmark_answers_help(name, capsys):
    module = importlib.import_module(name)
    command_line = getattr(module, "parse_args", None) or module.main
    with pytest.raises(SystemExit) as exit_:
        command_line(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_profile_methods_parsed_into_schedule_and_precision():
    args = speed.parse_args(["--profile-methods", "zigzag_exact,llama3_fp32"])
    assert args.profile_methods == [("zigzag", "exact"), ("llama3", "fp32")]
    assert speed.parse_args([]).profile_methods == [("zigzag", "fp32")]


@pytest.mark.parametrize("value", ["auto_fp32", "zigzag_bf16", "zigzag_fp32,"])
def test_bad_profile_method_is_a_clear_error(value, capsys):
    with pytest.raises(SystemExit):
        speed.parse_args(["--profile-methods", value])
    err = capsys.readouterr().err
    assert f"argument --profile-methods: has {value.split(',')[-1]!r}; valid: [" in err
    assert "'ring_fp32', 'ring_exact', 'zigzag_fp32'" in err


def test_gpu_accuracy_backends_parsed_and_checked(capsys):
    args = gpu_accuracy.parse_args(["--backends", "cudnn,triton_exact", "--out", "x.json"])
    assert args.backends == ["cudnn", "triton_exact"]
    assert gpu_accuracy.parse_args(["--out", "x.json"]).backends == ["cudnn", "flash",
                                                                     "triton_exact"]
    with pytest.raises(SystemExit):
        gpu_accuracy.parse_args(["--backends", "cudnn,tritonexact", "--out", "x.json"])
    err = capsys.readouterr().err
    assert ("argument --backends: has 'tritonexact'; valid: ['cudnn', 'flash', 'triton_exact']"
            in err)


def test_triton_tune_parts_parsed_and_checked(capsys):
    assert triton_tune.parse_args(["--out", "x.json"]).parts == ["forward", "dkdv", "dq"]
    assert triton_tune.parse_args(["--parts", "dkdv,dq", "--out", "x.json"]).parts == ["dkdv",
                                                                                       "dq"]
    with pytest.raises(SystemExit):
        triton_tune.parse_args(["--parts", "dkdv,dk", "--out", "x.json"])
    err = capsys.readouterr().err
    assert "argument --parts: has 'dk'; valid: ['forward', 'dkdv', 'dq']" in err


def test_mesh_parsed_as_ring_by_all_to_all_ranks(capsys):
    assert speed.parse_args(["--mesh", "2x2"]).mesh == (2, 2)
    assert speed.parse_args([]).mesh is None
    with pytest.raises(SystemExit):
        speed.parse_args(["--mesh", "2by2"])
    assert "argument --mesh: '2by2' is not OxI (ring ranks x all-to-all ranks" in (
        capsys.readouterr().err)


def test_methods_are_prefixes_and_a_trailing_dollar_is_one_name():
    names = [m.name for m in speed.selected(speed.all_methods("cuda"), "zigzag_fp32$,llama3_exact")]
    assert names == ["zigzag_fp32", "llama3_exact", "llama3_exact_compiled",
                     "llama3_exact_captured"]


def test_every_benchmark_json_names_its_commit():
    """``report.versions`` (every benchmark's meta) carries the tree's commit, as docs/results.md
    needs: a hash, ``+dirty`` where tracked files changed."""
    import re  # noqa: PLC0415

    import report  # noqa: PLC0415
    info = report.versions("cpu")
    commit = info["git_commit"]
    assert commit is not None and re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit), commit
    # The files' tree: the commit's own where nothing changed (a fresh clone, as in CI)
    assert info["git_tree"] is not None and re.fullmatch(r"[0-9a-f]{40}", info["git_tree"])
    if not commit.endswith("+dirty") and not _untracked():
        head_tree = subprocess.run(["git", "rev-parse", "HEAD^{tree}"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip()
        assert info["git_tree"] == head_tree


def _untracked():
    """Untracked files git does not ignore (they are in the files' tree, not in HEAD's)."""
    return subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
