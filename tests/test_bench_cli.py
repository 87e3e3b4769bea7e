"""``aristax bench``: lists and runs the scripts in experiments/benchmarks."""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

from aristax import cli

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "benchmarks"


def test_bench_without_a_name_lists_every_script_with_its_summary(capsys):
    assert cli.main(["bench"]) == 0
    lines = capsys.readouterr().out.splitlines()
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert len(scripts) >= 6 and len(lines) == len(scripts)
    for line, path in zip(lines, scripts):
        summary = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
        assert line.split() == [path.stem, *summary.split()]


def test_bench_unknown_name_lists_the_choices(capsys):
    assert cli.main(["bench", "decode"]) == 2
    err = capsys.readouterr().err
    assert re.match(r"aristax bench: no benchmark named 'decode'.*decode_vs_hf", err), err


def test_bench_passes_the_remaining_arguments_to_the_script(capfd):
    assert cli.main(["bench", "planner_lysi_scaling", "--help"]) == 0
    out = capfd.readouterr().out
    assert "usage: planner_lysi_scaling.py" in out and "--repeats" in out
    assert cli.main(["bench", "planner_lysi_scaling", "--repeats", "x"]) == 2  # its own error


@pytest.mark.parametrize("argv, words", [
    # a user trial: "foo" ran uniform routing labelled "foo"; 0 rounds wrote NaN
    # medians; a short shape gave a traceback; an unknown exchange was dropped
    (["moe_layer", "--loads", "foo"], "--loads 'foo': choose from uniform,zipf"),
    (["moe_layer", "--rounds", "0"], "argument --rounds: '0': give an integer >= 1"),
    (["moe_layer", "--shapes", "64,16,32"], "--shapes '64,16,32': give T,D,F,E,K"),
    (["ep_layer", "--exchanges", "bogus"], "['bogus'] are not exchanges"),
    # the other scripts' numbers and lists: tracebacks (or a silent empty run) before
    (["ep_layer", "--mesh", "abc"], "argument --mesh: 'abc': give axis sizes >= 1 joined by x"),
    (["ep_layer", "--mesh", "3x3"], "--mesh 3x3: give data x expert sizes whose product is "
                                    "--devices 8"),
    (["ep_layer", "--chunks", "1,,2"], "argument --chunks: '1,,2': give integers >= 1"),
    (["planner_lysi_scaling", "--repeats", "0"], "argument --repeats: '0': give an integer"),
    (["ragged_dot_cpu", "--rounds", "-1"], "argument --rounds: '-1': give an integer >= 1"),
    (["decode_vs_hf", "--batch", "-2"], "argument --batch: '-2': give an integer >= 0"),
    (["decode_vs_hf", "--sweep-experts", "2,x"], "argument --sweep-experts: '2,x'"),
    (["kernels", "--repeats", "x"], "argument --repeats: 'x' is not an integer"),
    (["gpu_check", "--budget-s", "nan"], "argument --budget-s: 'nan': give a finite number > 0"),
])
def test_bench_arguments_are_checked_before_anything_runs(argv, words, capfd):
    assert cli.main(["bench", *argv]) == 2
    err = capfd.readouterr().err
    assert words in err and "Traceback" not in err


def _bench_copy(name, tmp_path, monkeypatch):
    """``aristax bench`` runs a copy of the script, so that one which ignores its
    arguments writes under tmp_path, not over the committed results."""
    (tmp_path / "results").mkdir()
    (tmp_path / f"{name}.py").write_text((BENCHMARKS / f"{name}.py").read_text())
    monkeypatch.setattr(cli, "BENCHMARKS", tmp_path)


@pytest.mark.parametrize("name", ["planner_aristos", "planner_aurora"])
def test_bench_help_prints_usage_and_writes_nothing(name, tmp_path, monkeypatch, capfd):
    _bench_copy(name, tmp_path, monkeypatch)
    assert cli.main(["bench", name, "--help"]) == 0
    out = capfd.readouterr().out
    assert f"usage: {name}.py" in out and "--out" in out
    assert not any((tmp_path / "results").iterdir())


@pytest.mark.parametrize("name", ["planner_aristos", "planner_aurora"])
def test_bench_out_sets_the_results_path(name, tmp_path, monkeypatch, capfd):
    _bench_copy(name, tmp_path, monkeypatch)
    out = tmp_path / "out.json"
    assert cli.main(["bench", name, "--out", str(out)]) == 0
    assert "paper" in json.loads(out.read_text())
    assert not any((tmp_path / "results").iterdir())


def test_kernels_bench_records_a_failing_backend_and_goes_on(tmp_path, monkeypatch):
    """A backend that fails (here one the registry does not know, as a kernel's first
    compile on a new GPU might) is listed under "failures" with its error; the other
    rows are measured and the JSON is written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernels_bench", BENCHMARKS / "kernels.py")
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    monkeypatch.setattr(kernels, "available_backends", lambda registry=None: ["broken",
                                                                              "reference"])
    out = tmp_path / "kernels.json"
    monkeypatch.setattr("sys.argv", ["kernels.py", "--shapes", "fine", "--tokens", "16",
                                     "--loads", "uniform", "--repeats", "1", "--out", str(out)])
    kernels.main()
    result = json.loads(out.read_text())
    assert result["complete"]
    assert {(r["op"], r["impl"]) for r in result["rows"]} >= {
        ("ragged_dot", "reference"), ("moe_layer", "reference"), ("route", "reference")}
    assert not any(r["impl"] == "broken" for r in result["rows"])
    failed = {(f["op"], f.get("pass")) for f in result["failures"]}
    assert failed == {("ragged_dot", "fwd"), ("ragged_dot", "fwd_bwd"), ("moe_layer", None),
                      ("route", None)}
    assert all("broken" in f["error"] for f in result["failures"])
