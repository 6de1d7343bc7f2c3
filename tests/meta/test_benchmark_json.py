"""The ``--json FILE`` records of the benchmark scripts that the docs' pages are rendered
from: each script runs once with its smallest options; its record must hold the machine
and the settings, and every figure must be the one the script printed (formatted as
printed). The docs page's renderer must take the record as it is. No test asserts a
timing."""

from __future__ import annotations

import collections
import datetime
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from forked import Forker
from locations import ROOT, load_file

from ampkit.tools.bench.machine import cpu_flags, write_record

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import docs_pages  # noqa: E402


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"the record holds {name}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


_FORKER: list[Forker] = []


@pytest.fixture(autouse=True)
def _fresh_processes(forked_python: Forker):
    """Each script runs in a new process forked from one that imported torch and ampkit
    (``tests/support/forked.py``): a fresh process without ``import torch`` paid each time."""
    _FORKER.append(forked_python)
    yield
    _FORKER.pop()


def run_script(script: str, args: list[str], tmp_path: Path, timeout: int = 240) -> tuple[str, dict[str, Any]]:
    """Run ``benchmarks/SCRIPT ARGS --json FILE`` on one thread: (stdout, the record)."""
    out = tmp_path / f"{Path(script).stem}.json"
    proc = _FORKER[0].run_script(BENCH / script, [*args, "--json", str(out)], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith(f"wrote {out}")
    record = _strict_json(out.read_text())
    machine = record["machine"]
    assert list(record)[0] == "machine"
    assert machine["torch"] == torch.__version__
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["cpu_flags"] == cpu_flags() and machine["cpu_name"]
    assert machine["command"] == " ".join([script, *args, "--json", str(out)])
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(machine["date_utc"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(minutes=10)
    return proc.stdout, record


def renders(name: str, record: dict[str, Any], *cells: str) -> None:
    """The docs page's renderer takes the record and shows these cells."""
    page = docs_pages.RENDERERS[name](record)
    for cell in cells:
        assert f"| {cell} |" in page, (cell, page)


def tokens_after(line: str, width: int) -> tuple[str, list[str]]:
    """A printed row whose first column (which may hold spaces) is ``width`` wide."""
    return line[:width].strip(), line[width:].split()


def test_write_record_puts_the_machine_first_and_writes_nan_as_null(tmp_path):
    path = tmp_path / "r.json"
    written = write_record(path, {"rows": [{"ratio": float("nan"), "ms": 1.5, "inf": math.inf}]}, threads=3)
    record = _strict_json(path.read_text())
    assert record == written
    assert list(record) == ["machine", "rows"] and record["machine"]["threads"] == 3
    assert record["rows"] == [{"ratio": None, "ms": 1.5, "inf": None}]


def test_scaler_overhead_json_holds_both_printed_tables(tmp_path):
    stdout, record = run_script("scaler_overhead.py", ["--size", "tiny", "--rounds", "1", "--steps", "1"], tmp_path)
    s = record["settings"]
    assert (s["workload"], s["size"], s["rounds"], s["steps"], s["threads"]) == ("lm", "tiny", 1, 1, 1)
    assert f"({s['param_tensors']} param tensors, {s['params'] / 1e6:.2f}M params)" in stdout
    sections = stdout.split("\n\n")[1:]
    assert [t["name"] for t in record["tables"]] == ["scaler_only", "full_step"] and len(sections) == 2
    implementations = ["no scaler", "ampkit (init_trainer)", "ampkit.GradScaler", "torch.amp.GradScaler"]
    for table, section, unit in zip(record["tables"], sections, ("us", "ms")):
        lines = section.splitlines()
        assert lines[0] == table["title"] and f"median {unit}" in lines[1] and table["unit"] == unit
        rows = table["rows"]
        assert [r["implementation"] for r in rows] == implementations
        ref = rows[-1][f"median_{unit}"]
        for row, line in zip(rows, lines[3:]):
            name, cells = tokens_after(line, 24)
            assert name == row["implementation"]
            assert cells == [f"{row[f'median_{unit}']:.1f}", f"{row['vs_no_scaler']:.3f}x",
                             f"{row['vs_torch_grad_scaler']:.3f}x"]  # fmt: skip
            assert row["vs_torch_grad_scaler"] == pytest.approx(row[f"median_{unit}"] / ref)
        assert rows[0]["vs_no_scaler"] == 1.0 and rows[-1]["vs_torch_grad_scaler"] == 1.0
    renders("scaler_overhead", record, "ampkit (init_trainer)", f"{record['tables'][1]['rows'][1]['median_ms']:.1f}")


def _rows_by_first_word(stdout: str, names: list[str]) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in stdout.splitlines() if line.split()[:1] and line.split()[0] in names}


def test_engine_overhead_json_holds_the_printed_step_table(tmp_path):
    stdout, record = run_script("engine_overhead.py", ["--workloads", "lm", "--size", "tiny", "--rounds", "1",
                                                       "--steps", "1", "--device", "cpu"], tmp_path)  # fmt: skip
    assert record["measurement"] == "steps"
    s = record["settings"]
    assert (s["device"], s["dtype"], s["size"], s["rounds"], s["steps"], s["clock"]) == ("cpu", "bfloat16", "tiny", 1, 1, "wall")
    (row,) = record["rows"]
    printed = _rows_by_first_word(stdout, ["lm"])["lm"]
    assert printed == [f"{row['fp32_ms']:.1f}", f"{row['autocast_ms']:.1f}", f"{row['default_ms']:.1f}",
                       f"{row['custom_ms']:.1f}", f"{row['autocast_over_fp32']:.2f}",
                       f"{row['default_over_autocast']:.3f}", f"{row['custom_over_autocast']:.3f}"]  # fmt: skip
    assert row["default_over_autocast"] == pytest.approx(row["default_ms"] / row["autocast_ms"])
    assert row["autocast_over_fp32"] == pytest.approx(row["autocast_ms"] / row["fp32_ms"])
    renders("engine_overhead", record, "lm", f"{row['custom_ms']:.1f}")


def test_engine_overhead_micro_json_holds_the_printed_event_table(tmp_path):
    stdout, record = run_script("engine_overhead.py", ["--micro", "--rounds", "1"], tmp_path)
    assert record["measurement"] == "micro" and record["settings"]["device"] == "cpu"
    events = ["module call", "scope enter+exit", "overridden mm (fp32)", "overridden softmax (bf16)"]
    assert [r["event"] for r in record["rows"]] == events
    printed = dict(tokens_after(line, 26) for line in stdout.splitlines() if line[:26].strip() in events)
    for row in record["rows"]:
        assert printed[row["event"]] == [f"{row['torch_autocast_us']:.2f}", f"{row['ampkit_us']:.2f}",
                                         f"{row['added_us']:.2f}"]  # fmt: skip
        assert row["added_us"] == pytest.approx(row["ampkit_us"] - row["torch_autocast_us"])
    renders("engine_overhead", record, "scope enter+exit")


def test_doctor_overhead_json_holds_the_printed_table(tmp_path):
    stdout, record = run_script("doctor_overhead.py", ["--workloads", "lm", "--size", "tiny", "--rounds", "1",
                                                       "--steps", "1"], tmp_path)  # fmt: skip
    s = record["settings"]
    assert (s["dtype"], s["size"], s["rounds"], s["steps"], s["threads"]) == ("fp32", "tiny", 1, 1, 1)
    (row,) = record["rows"]
    assert row["workload"] == "lm"
    assert _rows_by_first_word(stdout, ["lm"])["lm"] == [
        f"{row['off_ms']:.1f}", f"{row['on_ms']:.1f}", f"{row['on_over_off']:.2f}", f"{row['check_ms']:.1f}",
        f"{row['check_over_off']:.2f}"]  # fmt: skip
    assert row["check_over_off"] == pytest.approx(row["check_ms"] / row["off_ms"])
    renders("doctor_overhead", record, "lm", f"{row['check_ms']:.1f}")


def test_host_overhead_json_holds_the_printed_tables_and_profile(tmp_path):
    host = load_file(BENCH / "host_overhead.py")
    arms = ["torch_amp", "pure16", "O1_init", "O1_scope"]
    stdout, record = run_script("host_overhead.py", ["--workload", "tiny", "--device", "cpu", "--rounds", "1",
                                                     "--steps", "1", "--warmup", "1", "--count-steps", "1",
                                                     "--profile-steps", "1", "--arms", ",".join(arms)], tmp_path)  # fmt: skip
    s = record["settings"]
    assert (s["device"], s["dtype"], s["rounds"], s["steps"], s["warmup"], s["threads"]) == ("cpu", "bfloat16", 1, 1, 1, 1)
    assert record["targets"] == {"O1_init": 1.10, "O1_scope": 1.10, "O2": 1.10, "O2K": 1.20}
    (wl,) = record["workloads"]
    assert (wl["workload"], wl["param_tensors"]) == ("tiny", 150) and [r["arm"] for r in wl["rows"]] == arms
    assert f"; {wl['param_tensors']} param tensors, {wl['params']:,} params" in stdout
    printed = _rows_by_first_word(stdout, arms)
    ref = wl["rows"][0]["cpu_ms"]
    for row in wl["rows"]:
        target = ["-"] if row["target"] is None else [f"<={row['target']:.2f}x", "met" if row["met"] else "missed"]
        assert printed[row["arm"]] == [f"{row['cpu_ms']:.2f}", f"{row['vs_torch_amp']:.3f}x",
                                       f"{row['host_reads']:.1f}", f"{row['host_reads_earlier']:.1f}", *target]  # fmt: skip
        assert row["vs_torch_amp"] == pytest.approx(row["cpu_ms"] / ref) and "wall_ms" not in row
        assert row["met"] == (None if row["target"] is None else row["vs_torch_amp"] <= row["target"])
        reads = wl["reads"][row["arm"]]
        total = row["host_reads"] + row["host_reads_earlier"]
        assert total == sum(reads["by_method"].values()) == sum(reads["by_site"].values())
        assert row["host_reads_earlier"] == sum(n for site, n in reads["by_site"].items() if site.endswith(host.EARLIER))
    assert wl["rows"][0]["vs_torch_amp"] == 1.0
    assert list(wl["profile"]) == arms
    for arm, prof in wl["profile"].items():
        assert (f"profile {arm}: {prof['profiled_ms']:.2f} ms/step profiled, ampkit's own code "
                f"{prof['ampkit_own_ms']:.2f} ms") in stdout  # fmt: skip
        assert len(prof["top"]) <= 12 and all(t["function"].startswith("ampkit/") for t in prof["top"])
        assert [t["cum_ms"] for t in prof["top"]] == sorted((t["cum_ms"] for t in prof["top"]), reverse=True)
    assert wl["profile"]["O1_scope"]["top"] and wl["profile"]["O1_scope"]["ampkit_own_ms"] > 0
    renders("host_overhead", record, "O1_scope", f"{wl['rows'][3]['cpu_ms']:.2f}", "torch_amp")


def test_host_overhead_counts_reads_only_while_open_and_restores_the_methods():
    host = load_file(BENCH / "host_overhead.py")
    before = {name: getattr(torch.Tensor, name) for name in host.READ_METHODS}
    counts: collections.Counter = collections.Counter()
    x = torch.ones(())
    with host.counting_reads(counts):
        x.item()
        bool(x)
        float(x)
        torch.ones(2).cpu()  # already on the CPU: no read
    x.item()
    assert sorted(m for m, _ in counts) == ["__bool__", "__float__", "item"] and sum(counts.values()) == 3
    assert all("test_benchmark_json.py" in site for _, site in counts)
    assert {name: getattr(torch.Tensor, name) for name in host.READ_METHODS} == before
    assert not set(host.READ_METHODS) & set(torch.Tensor.__dict__)


@pytest.mark.slow
def test_o2_op_casting_json_holds_the_speed_and_accuracy_tables(tmp_path):
    stdout, record = run_script("o2_op_casting.py", ["--size", "tiny", "--steps", "2", "--rounds", "1",
                                                     "--per-block", "1"], tmp_path)  # fmt: skip
    s = record["settings"]
    assert (s["size"], s["train_steps"], s["rounds"], s["per_block"]) == ("tiny", 2, 1, 1)
    speed = {m: (ms, x) for m, ms, x in re.findall(r"^  (.+?)\s+([\d.]+) ms\s+([\d.]+)x$", stdout, re.M)}
    assert [r["mode"] for r in record["speed"]] == list(speed) == [
        "O2 (fp32 ops in fp32)", "O2 without the scope", "O3 (pure bf16)"]  # fmt: skip
    for row in record["speed"]:
        assert speed[row["mode"]] == (f"{row['forward_backward_ms']:.2f}", f"{row['vs_o2_without_scope']:.3f}")
    assert record["speed"][1]["vs_o2_without_scope"] == 1.0
    pattern = r"^  (\S+)\s+train ([\d.]+) \((\S+)\)\s+eval ([\d.]+) \((\S+)\)$"
    accuracy = {m[0]: m[1:] for m in re.findall(pattern, stdout, re.M)}
    assert [r["mode"] for r in record["accuracy"]] == list(accuracy) == ["fp32", "O2", "O2-noscope", "O3"]
    fp32 = record["accuracy"][0]
    for row in record["accuracy"]:
        assert accuracy[row["mode"]] == (f"{row['train_loss']:.4f}", f"{row['train_change_vs_fp32']:+.2%}",
                                         f"{row['eval_loss']:.4f}", f"{row['eval_change_vs_fp32']:+.2%}")  # fmt: skip
        assert row["eval_change_vs_fp32"] == pytest.approx(row["eval_loss"] / fp32["eval_loss"] - 1)
    assert fp32["train_change_vs_fp32"] == 0.0 and math.isfinite(fp32["train_loss"])
    renders("o2_op_casting", record, "O2-noscope", f"{record['accuracy'][3]['eval_loss']:.4f}")


@pytest.mark.slow
def test_inference_json_holds_the_printed_rows(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    pytest.importorskip("rich")
    stdout, record = run_script("inference.py", ["--workload", "cnn", "--steps", "1", "--rounds", "1",
                                                 "--batch", "8"], tmp_path)  # fmt: skip
    assert record["settings"]["batch"] == 8 and record["settings"]["opt_level"] == "O2"
    (wl,) = record["workloads"]
    assert (wl["workload"], wl["train_steps"], wl["batch"]) == ("cnn", 1, 8)
    printed = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 9:
            printed[(cells[0], cells[1])] = cells[2:]
    keys = [("fp32", "PyTorch"), ("bf16", "PyTorch"), ("fp32", "onnxruntime"), ("bf16", "onnxruntime storage"),
            ("fp16", "onnxruntime compute")]  # fmt: skip
    assert [(r["model"], r["runtime"]) for r in wl["rows"]] == keys and set(printed) == set(keys)
    for row in wl["rows"]:
        assert printed[(row["model"], row["runtime"])] == [
            f"{row['size_mib']:.3f}", f"{row['ms_per_batch']:.2f}", f"{row['items_per_s']:,.0f}",
            f"{row['speedup_vs_fp32']:.2f}x", f"{row['rel_error']:.2e}", f"{row['top1_agreement']:.2%}",
            f"acc {row['accuracy']:.2%}"]  # fmt: skip
        assert row["size_mib"] == row["weight_bytes"] / 2**20 and row["metric"] == f"acc {row['accuracy']:.2%}"
    by_key = {(r["model"], r["runtime"]): r for r in wl["rows"]}
    storage = by_key[("bf16", "onnxruntime storage")]
    assert storage["speedup_vs_fp32"] == pytest.approx(by_key[("fp32", "onnxruntime")]["ms_per_batch"] / storage["ms_per_batch"])
    renders("inference", record, "onnxruntime storage", f"{storage['rel_error']:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compile_json_holds_the_printed_step_table_and_compile_times(tmp_path):
    stdout, record = run_script("compile.py", ["--size", "tiny", "--workloads", "cnn", "--rounds", "1",
                                               "--steps", "1"], tmp_path, timeout=540)  # fmt: skip
    assert record["measurement"] == "steps" and record["settings"]["size"] == "tiny"
    (row,) = record["rows"]
    assert _rows_by_first_word(stdout, ["cnn"])["cnn"] == [
        f"{row['autocast_ms']:.1f}", f"{row['default_ms']:.1f}", f"{row['custom_ms']:.1f}", f"{row['o2_ms']:.1f}",
        f"{row['default_over_autocast']:.3f}", f"{row['custom_over_autocast']:.3f}",
        f"{row['o2_over_autocast']:.3f}"]  # fmt: skip
    assert row["o2_over_autocast"] == pytest.approx(row["o2_ms"] / row["autocast_ms"])
    warm = dict(re.findall(r"^  cnn: (.+) compiled and warmed up in (\d+) s$", stdout, re.M))
    modes = ["torch.autocast", "ampkit default", "ampkit custom", "ampkit O2"]
    assert list(row["compile_warmup_s"]) == list(warm) == modes
    assert all(warm[m] == f"{row['compile_warmup_s'][m]:.0f}" for m in modes)
    renders("compile", record, "cnn", f"{row['o2_ms']:.1f}")


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_json_holds_the_printed_table_and_targets(tmp_path):
    stdout, record = run_script("ddp.py", ["--nproc", "2", "--steps", "1", "--blocks", "1", "--warmup", "0",
                                           "--levels", "off,O1"], tmp_path)  # fmt: skip
    s = record["settings"]
    assert (s["nproc"], s["workload"], s["levels"], s["device"], s["dtype"]) == (2, "wide", ["off", "O1"], "cpu", "bfloat16")
    assert record["targets"] == {"collectives_auto": 1, "collectives_never": 0}
    off, o1 = record["rows"]
    printed = _rows_by_first_word(stdout, ["off", "O1"])
    for row, tail in ((off, ["-", "-"]), (o1, [f"{o1['n_procs_never_ms']:.2f}", f"{o1['collectives_auto']}",
                                              "auto", "/", f"{o1['collectives_never']}", "never"])):  # fmt: skip
        assert printed[row["level"]] == [
            f"{row['one_proc_ms']:.2f}", f"{row['n_procs_ms']:.2f}", f"{row['n_over_one']:.2f}",
            f"{row['samples_per_s_one_proc']:.0f}", f"{row['samples_per_s_n_procs']:.0f}", *tail]  # fmt: skip
        assert row["samples_per_s_n_procs"] == pytest.approx(1000 * 2 * s["batch_per_process"] / row["n_procs_ms"])
    assert off["collectives_auto"] is None and off["n_procs_never_ms"] is None
    assert (o1["collectives_auto"], o1["collectives_never"]) == (1, 0)  # what ampkit promises
    renders("ddp", record, "O1", "1 / 0")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_first_step_json_holds_the_printed_table(tmp_path):
    """fp32 (every row's reference) and O2K (a level that compiles: its cold and warm first
    steps differ) stand for the four levels the docs run records; O1 and O2 add no column.
    The character GPT stands for both models (the bench's ``lm`` is the same code with the
    bench's own sizes); the notice column says whether ampkit announced a compile."""
    for argv, message in ((["--levels", "O2K,fp32"], "fp32 first"), (["--workloads", "lm,gpt"], "distinct names")):
        bad = _FORKER[0].run_script(BENCH / "first_step.py", argv, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    stdout, record = run_script("first_step.py", ["--size", "tiny", "--levels", "fp32,O2K", "--workloads", "chargpt"],
                                tmp_path, timeout=800)  # fmt: skip
    assert (record["workload"], record["size"]) == ("chargpt", "6 layers × 384") and record["warmup_s"] > 0
    assert record["more"] == []
    levels = [r["level"] for r in record["rows"]]
    assert levels == ["fp32", "O2K"] and "`ampkit warmup` (O2K, AdamW)" in stdout
    printed = _rows_by_first_word(stdout, levels)
    fp32 = record["rows"][0]
    assert fp32["cold_notice"] is False and fp32["warm_notice"] is False  # fp32 compiles nothing
    for row in record["rows"]:
        assert printed[row["level"]] == [
            f"{row['cold_first_s']:.2f}", f"{row['cold_over_fp32_s']:+.2f}", f"{row['warm_first_s']:.2f}",
            f"{row['warm_over_fp32_s']:+.2f}", f"{row['later_step_s']:.3f}",
            f"{'yes' if row['cold_notice'] else 'no'}/{'yes' if row['warm_notice'] else 'no'}"]  # fmt: skip
        assert row["cold_over_fp32_s"] == pytest.approx(row["cold_first_s"] - fp32["cold_first_s"])
    renders("first_step", record, "O2K", "warm first step s")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fsdp_memory_json_holds_the_printed_table(tmp_path):
    stdout, record = run_script("fsdp_memory.py", ["--d-model", "64", "--layers", "2"], tmp_path, timeout=500)
    rows = {r["arm"]: r for r in record["rows"]}
    assert list(rows) == ["fp32", "fsdp2-bf16", "O1", "O2", "O2K", "O3"] and record["world"] == 2
    printed = _rows_by_first_word(stdout, list(rows))
    for arm, r in rows.items():
        assert printed[arm] == [f"{r[k]:.2f}" for k in ("params", "grads", "optimizer", "ampkit", "total")] + [
            f"{r['vs_fsdp2_bf16']:.2f}x"]  # fmt: skip
        assert r["total"] == pytest.approx(r["params"] + r["grads"] + r["optimizer"] + r["ampkit"])
    # what the levels promise, per rank: O2K below FSDP2's own bf16 mixed precision
    assert rows["O2K"]["total"] < rows["fsdp2-bf16"]["total"] and rows["O2K"]["ampkit"] > 0
    assert rows["O2"]["total"] == pytest.approx(rows["fsdp2-bf16"]["total"], rel=0.01)
    renders("fsdp_memory", record, "O2K", "vs fsdp2-bf16")


def test_tune_json_holds_the_printed_tables(tmp_path):
    stdout, record = run_script("tune.py", ["--size", "tiny", "--workloads", "wide,lm"], tmp_path, timeout=600)
    assert record["budget"] == 0.01 and [r["workload"] for r in record["results"]] == ["wide", "lm"]
    arms = ["fp32", "O1", "O2", "O2K", "plan"]
    for r in record["results"]:
        assert list(r["arms"]) == arms and r["plan"]["level"] in ("O0", "O1", "O2", "O2K")
        header = f"{r['workload']} ({r['size']}, {r['steps']} steps): plan {r['plan']['lowered']}/{r['plan']['modules']}"
        block = stdout.split(header, 1)[1].split("plan vs the fastest", 1)[0]
        printed = _rows_by_first_word(block, arms)
        for arm, a in r["arms"].items():
            assert printed[arm][:4] == [f"{a['step_ms']:.2f}", f"{a['speed_vs_fp32']:.2f}x", f"{a['loss']:.4f}",
                                        f"{a['deviation']:.2%}"]  # fmt: skip
            assert a["within_budget"] == (a["deviation"] <= record["budget"])
        best = r["fastest_uniform_within_budget"]
        assert r["plan_speed_vs_fastest_uniform"] == pytest.approx(r["arms"][best]["step_ms"] / r["arms"]["plan"]["step_ms"])
    renders("tune", record, "plan", "O2K")
    # where this CPU does not compute fp8 the plan says why it was not tried, and so does the output
    for r in record["results"]:
        assert r["plan"]["fp8"] == [] and "fp8" in r["plan"]["skipped"]
    assert stdout.count("not tried: fp8: ") == 2
    # the GPU check's tune stage reads this very file (tmp_path/tune.json) for its summary
    head = load_file(BENCH / "gpu_check.py").headline("tune", tmp_path)
    for r in record["results"]:
        mine = head[r["workload"]]
        assert mine["plan"]["fp8"] == r["plan"]["fp8"] and mine["plan"]["level"] == r["plan"]["level"]
        assert mine["speed_vs_fp32"] == {a: v["speed_vs_fp32"] for a, v in r["arms"].items()}
