"""``benchmarks/run_overhead.py`` (``ampkit run --level O2`` against the script edited to
call ``amp.initialize``) at its smallest: one round of each arm and their profiles. Its
``--json`` record holds the machine, both arms, the ratio as printed and the profile;
the two arms end on the same loss, bit for bit (``ampkit run`` trains as the edited
script does). No test asserts a timing."""

from __future__ import annotations

import json

import pytest
import torch
from locations import ROOT

from ampkit.tools.bench.machine import cpu_flags

SCRIPT = ROOT / "benchmarks" / "run_overhead.py"


@pytest.mark.slow
def test_run_overhead_json_holds_both_arms_the_ratio_and_the_profile(tmp_path, forked_python):
    out = tmp_path / "run_overhead.json"
    args = ["--rounds", "1", "--steps", "3", "--warmup", "1", "--layers", "1", "--profile", str(tmp_path / "prof"),
            "--json", str(out)]  # fmt: skip
    proc = forked_python.run_script(SCRIPT, args, timeout=240)  # python SCRIPT ARGS, in a forked process
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    record = json.loads(out.read_text())
    assert list(record)[0] == "machine" and record["machine"]["torch"] == torch.__version__
    assert record["cpu_kind"] == [f for f in ("amx_bf16", "avx2", "avx512_bf16") if f in cpu_flags()]
    assert (record["settings"]["rounds"], record["settings"]["steps"], record["settings"]["layers"]) == (1, 3, 1)
    arms = record["arms"]
    assert list(arms) == ["run", "initialize"]
    for name, arm in arms.items():
        (run,) = arm["runs"]
        assert run["steps_timed"] == 2 and run["cpu_ms_per_step"] == arm["cpu_ms_per_step"] > 0
        assert run["variant"] == {"run": "plain", "initialize": "edited"}[name]
        assert f"{name:<10} median {arm['cpu_ms_per_step']:8.2f} ms/step" in proc.stdout
    ratio = record["run_over_initialize"]
    assert ratio == pytest.approx(arms["run"]["cpu_ms_per_step"] / arms["initialize"]["cpu_ms_per_step"])
    assert record["target"] == 1.03 and record["met"] == (ratio <= 1.03)
    assert record["speed"] == pytest.approx(1 / ratio)
    assert f"run / initialize: {ratio:.3f}x time per step ({record['speed']:.3f}x the speed)" in proc.stdout
    assert record["same_final_loss"] and arms["run"]["final_loss"] == arms["initialize"]["final_loss"]
    profile = record["profile"]
    assert set(profile) == {"run", "initialize", "difference"}
    assert any("tools/run/" in row["function"] for row in profile["run"]["top"])
    assert not any("tools/run/" in row["function"] for row in profile["initialize"]["top"])
    assert profile["difference"] and (tmp_path / "prof" / "run.prof").exists()
    assert proc.stdout.rstrip().endswith(f"wrote {out}")
