"""bench/per_rank.py on the CPU: the smoke run (every method x 2 kv-head configs x every rank of
W = 4, host clock), its JSON and table, the --capture bookkeeping with a stand-in for the CUDA
graph (no GPU here), --help, and bad arguments as argparse errors naming the value and the valid
choices."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import graph_capture  # noqa: E402
import per_rank  # noqa: E402

import dtensor_ring as dr  # noqa: E402

SMOKE = ["--device", "cpu", "--world", "4", "--tokens-per-gpu", "16", "--heads", "4",
         "--kv-heads", "4,2", "--head-dim", "16", "--iters", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def one_thread():
    # Tiny ops: intra-op threads only add contention (the smoke run takes 1 s, not 20, on 2 busy
    # cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smoke(one_thread, tmp_path_factory):
    path = tmp_path_factory.mktemp("per_rank") / "smoke.json"
    result = per_rank.main([*SMOKE, "--out", str(path), "--plot", str(path.with_suffix(".png"))])
    return result, path


def test_smoke_run_with_packed_documents(one_thread):
    """--documents: every method on a long-tailed mix of documents, the ideal a varlen call; the
    mix placed as dr.pad_documents(world_size=W, length=the row) places it (short documents
    whole, the exchanges' bytes below every row's), or as it is (--placement none: every
    document cut, every row exchanged)."""
    argv = ["--device", "cpu", "--world", "4", "--tokens-per-gpu", "128", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "16", "--iters", "1", "--warmup", "0", "--methods",
            "ideal,zigzag_fp32,llama3_exact", "--documents"]
    rows = per_rank.main(argv)["rows"]
    assert [r["error"] for r in rows] == [None] * 3
    cu = rows[0]["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == 512 and all(b > a for a, b in zip(cu, cu[1:]))
    assert rows[0]["documents"] == len(cu) - 1 >= 3 and rows[1]["frac_fwd_bwd"] > 0
    assert per_rank.placed_mix(512, 4, 0) == tuple(cu)
    for row in rows[1:]:
        assert row["documents_whole"] > 0 and 0 < row["bytes_fraction"] < 1
        assert row["bytes_fwd"] < row["bytes_fwd_bwd"]
    rows = per_rank.main([*argv, "--placement", "none"])["rows"]
    assert tuple(rows[0]["cu_seqlens"]) == per_rank.document_mix(512, 4, 0)
    assert all(r["bytes_fraction"] == 1 and r["documents_whole"] == 0 for r in rows[1:])


def test_fp32_backend_picks_the_document_kernel(one_thread):
    """--fp32-backend holds with --documents: the named kernel runs the fp32 rows (it was
    ignored, auto's kernel ran); one without a varlen form is the row's error, naming it."""
    argv = ["--device", "cpu", "--world", "2", "--tokens-per-gpu", "64", "--heads", "2",
            "--kv-heads", "2", "--head-dim", "16", "--iters", "1", "--warmup", "0", "--methods",
            "zigzag_fp32", "--documents", "--no-profile"]
    (row,) = per_rank.main([*argv, "--fp32-backend", "math"])["rows"]
    assert row["error"] is None and row["kernel"] == "math"
    (row,) = per_rank.main(argv)["rows"]
    assert row["error"] is None and row["kernel"] == "cpu_flash"
    (row,) = per_rank.main([*argv, "--fp32-backend", "cudnn"])["rows"]
    assert "backend='cudnn'" in row["error"]


def test_smoke_run_with_a_sliding_window(one_thread):
    """--window: every method with a window shorter than a rank's share (steps skipped), the
    ideal the CPU kernel with the window over the whole sequence; the ranks' fractions of it are
    finite, and the JSON and table say the window."""
    result = per_rank.main([*SMOKE, "--kv-heads", "2", "--window", "5", "--methods",
                            "ideal,ring_fp32,zigzag_exact,stripe_fp32,llama3_fp32"])
    rows = result["rows"]
    assert [r["error"] for r in rows] == [None] * 5
    assert all(r["window"] == 5 for r in rows) and result["meta"]["window"] == 5
    assert rows[0]["method"] == "ideal_cpu_flash" and all(r["frac_fwd_bwd"] > 0 for r in rows)
    config = per_rank.configs(per_rank.parse_args([*SMOKE, "--window", "5"]))[0]
    assert config.window_arg() == (4, -1)  # Hugging Face's sliding_window=5


def test_smoke_run_with_inputs_in_a_models_layout(one_thread):
    """--layout bshd: q, k, v, dout as a model's projections make them ([B, S, H, D] memory), for
    the ring and the ideal alike."""
    x = per_rank.make_inputs(per_rank.Config(4, 16, 4, 2, 16, 1, True, torch.bfloat16,
                                             layout="bshd"), 16, "cpu", 0, kv_repeat=2)
    assert x.q.shape == x.k.shape == (1, 4, 16, 16) and x.q.transpose(1, 2).is_contiguous()
    assert x.k.transpose(1, 2).is_contiguous() and torch.equal(x.k[:, 0], x.k[:, 1])
    result = per_rank.main([*SMOKE, "--kv-heads", "2", "--layout", "bshd", "--methods",
                            "ideal,zigzag_fp32,llama3_fp32,stripe_exact"])
    assert [r["error"] for r in result["rows"]] == [None] * 4
    assert result["meta"]["layout"] == "bshd"


def test_smoke_run_measures_every_method_and_rank(smoke):
    result, path = smoke
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))  # written, complete
    rows, meta = result["rows"], result["meta"]
    assert [(r["kv_heads"], r["method"]) for r in rows] == [
        (kv, m) for kv in (4, 2) for m in ["ideal_cpu_flash"] + list(per_rank.METHODS[1:])]
    assert [r["error"] for r in rows] == [None] * len(rows)
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["host_fwd_ms"] > 0
        assert r["frac_fwd"] > 0 and r["frac_fwd_bwd"] > 0
        assert r["ideal_fwd_ms_from"] == "ideal_cpu_flash"
        if r["kind"] == "ours":
            assert [p["rank"] for p in r["per_rank"]] == [0, 1, 2, 3]
            assert r["fwd_bwd_ms"] == max(p["fwd_bwd_ms"] for p in r["per_rank"])
            assert r["kernel"] == ("cpu_flash" if r["method"].endswith("fp32")
                                   else "cpu_flash_exact")
            assert r["comm_buffers_gib"] > 0
    assert meta["command"].startswith("python bench/per_rank.py --device cpu --world 4")
    assert meta["torch"] == torch.__version__ and "git_commit" in meta and meta["world"] == 4
    try:
        import matplotlib  # noqa: F401, PLC0415 - optional
    except ImportError:
        return
    assert path.with_suffix(".png").stat().st_size > 0


def test_table_printed(smoke, capsys):
    result, _ = smoke
    per_rank.print_table(result["meta"], result["rows"])
    out = capsys.readouterr().out
    assert "tok/GPU  kv method" in out and out.count("zigzag_exact") == 2


def test_capture_bookkeeping_with_a_stand_in_graph(smoke, monkeypatch, capsys):
    """The real capture needs CUDA; a stand-in that replays by calling eagerly checks what is
    done with its results, and a failing one how an error is kept (message, cause, file:line)."""
    result, _ = smoke
    rows = json.loads(json.dumps(result["rows"]))

    current = {}

    class Recorded(per_rank.Schedule):
        def __init__(self, name, *rest):
            super().__init__(name, *rest)
            current["method"] = name

    def stand_in(call, args, outputs):
        out = {}
        for backward, key in ((False, "fwd"), (True, "fwd_bwd")):
            first, again = call(backward), call(backward)
            if backward and current.get("method") == "ring_exact":
                try:
                    try:
                        dr.get_schedule("not_a_schedule")
                    except ValueError as exc:
                        raise RuntimeError("capture ended with an error") from exc
                except RuntimeError as exc:
                    out[key] = graph_capture.failure(exc)
                continue
            counts, largest = graph_capture.differences(again, first, outputs[backward])
            out[key] = dict(ms=1.0, host_ms=0.01, replay_vs_eager=counts,
                            replay_max_abs=largest, eager_vs_eager=counts, eager_max_abs=largest)
        return out

    monkeypatch.setattr(per_rank, "Schedule", Recorded)
    monkeypatch.setattr(per_rank, "graph_measure", stand_in)
    args = per_rank.parse_args(SMOKE)
    args.capture = True
    per_rank.capture_pass(args, result["meta"], rows, per_rank.Clock(args))
    by_name = {(r["kv_heads"], r["method"]): r["graph"] for r in rows}
    zigzag = by_name[(4, "zigzag_fp32")]
    assert zigzag["fwd_ms"] == 1.0 and [p["rank"] for p in zigzag["per_rank"]] == [0, 1, 2, 3]
    assert zigzag["fwd_bwd_replay_vs_eager"] == dict(out=0, lse=0, dq=0, dk=0, dv=0)
    assert by_name[(4, "ideal_cpu_flash")]["fwd_ms"] == pytest.approx(1.0 / 4)  # time / W
    ring_exact = by_name[(2, "ring_exact")]
    assert "fwd_bwd_ms" not in ring_exact and ring_exact["fwd_ms"] == 1.0
    error = ring_exact["fwd_bwd_error"]
    assert error["rank"] == 0 and error["error"] == "RuntimeError: capture ended with an error"
    assert error["cause"].startswith("ValueError: schedule='not_a_schedule' is not a known")
    assert error["cause_at"].startswith("dtensor_ring/schedules/__init__.py:")
    per_rank.print_table(result["meta"], rows)
    out = capsys.readouterr().out
    assert "replay = eager bit for bit" in out
    assert "fwd_bwd: ERROR ValueError: schedule='not_a_schedule'" in out


def test_differences_count_bits():
    a = torch.tensor([1.0, -0.0, float("nan"), 2.0])
    b = torch.tensor([1.0, 0.0, float("nan"), 2.5])
    counts, largest = graph_capture.differences([a], [b], ["x"])
    assert counts == {"x": 2} and largest is None  # -0.0 vs 0.0 differs; NaN vs NaN does not


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        per_rank.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for action in per_rank.build_parser()._actions:
        assert action.help, action.option_strings
        assert all(opt in out for opt in action.option_strings)


@pytest.mark.parametrize("argv, message", [
    (["--methods", "zigzag_fp32,zigzag_bf16"],
     "argument --methods: has 'zigzag_bf16'; valid: ['ideal', 'ring_fp32', 'ring_exact', "),
    (["--kv-heads", "32,5"],
     "argument --kv-heads: 5 does not divide --heads 32; valid: [1, 2, 4, 8, 16, 32]"),
    (["--ranks", "1,4"], "argument --ranks: 4 is not a rank of --world 4; valid: all or 0..3"),
    (["--capture"], "argument --capture: needs --device cuda (CUDA graphs)"),
    (["--tokens-per-gpu", "2048,4k"],
     "argument --tokens-per-gpu: has '2048,4k'; expected comma-separated integers >= 1"),
    (["--world", "0"], "argument --world: has '0'; expected an integer >= 1"),
    (["--warmup", "-1"], "argument --warmup: has '-1'; expected an integer >= 0"),
    (["--fp32-backend", "cudnn2"], "argument --fp32-backend: invalid choice: 'cudnn2' (choose "
                                   "from auto, cpu_flash, cudnn, efficient, flash, flash_attn, "
                                   "math)"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8' (choose from bf16, fp16)"),
    (["--layout", "sbhd"], "argument --layout: invalid choice: 'sbhd' (choose from bhsd, bshd)"),
    (["--window", "0"], "argument --window: has '0'; expected an integer >= 1"),
    (["--window", "64", "--documents"], "argument --window: not with --documents"),
])
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        per_rank.parse_args(["--device", "cpu", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err.replace("'auto', 'cpu_flash', 'cudnn', 'efficient', 'flash', "
                                  "'flash_attn', 'math'",
                                  "auto, cpu_flash, cudnn, efficient, flash, flash_attn, math"
                                  ).replace("'bf16', 'fp16'", "bf16, fp16"
                                  ).replace("'bhsd', 'bshd'", "bhsd, bshd"), err
