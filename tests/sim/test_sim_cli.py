"""``kvmesh sim``: runs, sweeps and errors through the real entry point."""

import json

from kvmesh.cli import main

WORKLOAD = """
type: shared_prefix
num_groups: 6
num_prompts_per_group: 3
system_prompt_len: 512
question_len: 64
output_len: 8
stages: [{rate: 20, duration: 3}]
seed: 1
"""


def test_sim_workload_json(tmp_path, capsys):
    wl = tmp_path / "w.yaml"
    wl.write_text(WORKLOAD)
    code = main([
        "sim", "--workload", str(wl), "--replicas", "3", "--model-preset", "tiny-h100",
        "--policies", "precise,random", "--shared-tier", "redis", "--net-gbps", "25", "--json",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"precise", "random"}
    for run in out.values():
        assert run["summary"]["num_ok"] == run["summary"]["num_requests"] > 0
        assert len(run["replicas"]) == 3
        assert run["network"]["write_bytes"] > 0
        assert {"ttft", "tpot", "itl", "e2e"} <= set(run["summary"])


def test_sim_table_output_and_plots(tmp_path, capsys):
    wl = tmp_path / "w.yaml"
    wl.write_text(WORKLOAD)
    code = main([
        "sim", "--workload", str(wl), "--replicas", "2", "--model-preset", "tiny-h100",
        "--out", str(tmp_path / "out"),
    ])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "precise" in text and "fleet" in text
    assert (tmp_path / "out" / "ttft_cdf.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "sim.json").read_text())["precise"]["summary"]["num_ok"] > 0


def test_sim_sweep_writes_a_plot_with_and_without_sharing(tmp_path, capsys):
    wl = tmp_path / "w.yaml"
    wl.write_text(WORKLOAD)
    plot = tmp_path / "sweep.png"
    code = main([
        "sim", "sweep", "--workload", str(wl), "--model-preset", "tiny-h100", "--replicas", "1,2",
        "--qps", "10", "--duration", "2", "--plot", str(plot), "--json",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    points = out["points"]
    assert [(p["replicas"], p["shared"]) for p in points] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(p["cost_per_1k_usd"] > 0 for p in points)
    assert plot.stat().st_size > 0


def test_sim_errors_are_clear(tmp_path, capsys):
    assert main(["sim"]) == 2
    assert "--preset" in capsys.readouterr().err
    assert main(["sim", "--preset", "nope"]) == 2
    assert "unknown sim preset 'nope'" in capsys.readouterr().err
    wl = tmp_path / "w.yaml"
    wl.write_text(WORKLOAD)
    assert main(["sim", "--workload", str(wl), "--replicas", "2", "--model-preset", "gpu-9000"]) == 2
    assert "unknown emulation preset" in capsys.readouterr().err
