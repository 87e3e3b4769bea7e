"""`aristax plan` in-process: register on a fresh parser, parse, run, read stdout."""

import argparse
import sys

import numpy as np
import pytest

from aristax import cli
from aristax.planner import Plan
from aristax.planner.cli import parse_topology, register
from aristax.planner.topology import perlmutter, uniform


def parse(argv):
    parser = argparse.ArgumentParser(prog="aristax")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_plan_preset_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = parse(["plan", "perlmutter:2", "--experts", "16", "--top-k", "1", "--tokens", "512",
                  "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "plan for perlmutter-2x4: 8 devices, 16 experts" in text
    assert "rounds" in text and "partitions (Lancet 5.1)" in text
    assert "simulated iteration time:" in text and "─" in text  # a rich table rule
    plan = Plan.from_json(out.read_text())
    # device table: one row per device "device group node #exp experts"
    devices_part, groups_part = text.split("all-to-all per group")
    rows = [l.split() for l in devices_part.splitlines() if l.strip() and l.split()[0].isdigit()]
    assert all(len(r) == 5 for r in rows)
    assert sorted(int(r[0]) for r in rows) == list(range(8))
    for r in rows:
        d = int(r[0])
        g = next(k for k, grp in enumerate(plan.groups) if d in grp)
        assert int(r[1]) == g and int(r[2]) == d // 4  # perlmutter: 4 GPUs per node
        assert tuple(int(x) for x in r[4].split(",")) == plan.experts_on(g)[d]
        assert int(r[3]) == len(plan.experts_on(g)[d])
    # group table: "group size rounds dispatch_us lower_bound_us", also 5 numeric fields
    grows = [l.split() for l in groups_part.split("partitions")[0].splitlines()
             if l.strip() and l.split()[0].isdigit()]
    assert [int(r[0]) for r in grows] == list(range(len(plan.groups)))
    for r in grows:
        s = plan.schedules[int(r[0])]
        assert int(r[1]) == len(plan.groups[int(r[0])]) and int(r[2]) == s.num_rounds
        assert float(r[3]) == pytest.approx(s.makespan * 1e6, abs=0.06)


def test_plan_topology_file(tmp_path, capsys):
    path = tmp_path / "top.yaml"
    perlmutter(1).save(path)
    args = parse(["plan", str(path), "--experts", "8", "--d-model", "64", "--d-ff", "128"])
    assert args.func(args) == 0
    assert "4 devices, 8 experts" in capsys.readouterr().out


def test_plan_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    args = parse(["plan", "perlmutter:2", "--experts", "16", "--png", str(out)])
    assert args.func(args) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"wrote {out}" in capsys.readouterr().out.replace("\n", "")


def test_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    args = parse(["plan", "perlmutter:1", "--experts", "8", "--png", str(tmp_path / "p.png")])
    with pytest.raises(ImportError, match=r"pip install 'aristax\[plot\]'"):
        args.func(args)



def test_bad_arguments_print_a_message_and_exit_2(tmp_path, capsys):
    """``aristax.cli.main`` prints the handler's ValueError as one line."""
    for argv, said in ((["--png", str(tmp_path / "p.jpg")], "--png"),
                       # checked before planning, not after the tables were printed
                       (["--json", str(tmp_path / "no" / "p.json")], "does not exist"),
                       (["--json", str(tmp_path)], "is a directory"),
                       # ModelSpec's and make_plan's errors name the flags (a user
                       # trial: "ModelSpec.num_experts must be a positive integer")
                       (["--top-k", "100"], "--top-k=100 must be between 1 and --experts=8"),
                       (["--experts", "100000"], "but --experts = 100000"),
                       (["--experts", "0"], "argument --experts: '0': give an integer >= 1"),
                       (["--tokens", "-3"], "argument --tokens: '-3'")):
        try:
            code = cli.main(["plan", "perlmutter:1", "--experts", "8", *argv])
        except SystemExit as stop:  # argparse's own errors exit
            code = stop.code
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("aristax plan: ") and said in err
        assert err.count("\n") == 1 and "ModelSpec" not in err and "num_experts" not in err, err


def test_preset_keyword_arguments():
    """A user trial: a preset's keyword-only parameters (expert_capacity, flops...) could
    not be given on the command line ("uniform:8,expert_capacity=2": "must be
    integers"), so every small-E preset plan was groups of one device. They are taken
    as key=value after the positional ones, checked by the preset's own signature."""
    top = parse_topology("uniform:8,expert_capacity=2,flops=2e14")
    want = uniform(8, expert_capacity=2, flops=2e14)
    np.testing.assert_array_equal(top.expert_capacity, want.expert_capacity)
    np.testing.assert_array_equal(top.flops, want.flops)
    with pytest.raises(ValueError, match=r"too many positional.*num_devices, \*, alpha"):
        parse_topology("uniform:8,2")
    with pytest.raises(ValueError, match="unexpected keyword argument 'bogus'"):
        parse_topology("uniform:8,bogus=2")
    with pytest.raises(ValueError, match="expert_capacity=2.5 must be a number \\(int\\)"):
        parse_topology("uniform:8,expert_capacity=2.5")
    with pytest.raises(ValueError, match="positional ones come before key=value"):
        parse_topology("uniform:expert_capacity=2,8")


def test_bad_topology_spec():
    with pytest.raises(ValueError, match="preset"):
        parse_topology("nosuch:3")
    with pytest.raises(ValueError, match="did you mean perlmutter"):
        parse_topology("perlmuter:3")
    with pytest.raises(ValueError, match="too many positional arguments.*nodes=4"):
        parse_topology("perlmutter:1,2")
    with pytest.raises(ValueError, match="limit of 4096.*at most 1024 nodes"):
        parse_topology("perlmutter:100000")
    with pytest.raises(ValueError, match="must be numbers, positional or key=value"):
        parse_topology("perlmutter:x")
    with pytest.raises(ValueError, match="does not exist"):
        parse_topology("missing.yaml")
    assert parse_topology("heterogeneous_mix:1,1").num_devices == 12
