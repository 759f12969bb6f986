"""benchmarks/peers.py end to end on a tiny Qwen3.5-shaped model: every engine installed here runs both
precisions it can, the rest are listed with a reason, and the JSON, table and plot are written."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_peer_benchmark_runs_every_installed_engine_on_a_tiny_model(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_SRC"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--config", "tiny", "--quick", "--positions", "32,96",
         "--steps", "3", "--threads", "1", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "peers-quick-tiny.json").read_text())
    assert report["positions"] == [32, 96] and report["machine"]["copy_bandwidth_GBps"] > 0
    floor = report["floor"]
    assert 0 < floor["int4"]["weight_bytes"] < floor["fp32"]["weight_bytes"]
    ran = {"edgemem"} | {e for e, m in (("genai", "onnxruntime_genai"), ("transformers", "transformers"))
                         if importlib.util.find_spec(m)}
    for engine in ("edgemem", "genai", "llama.cpp", "transformers"):
        for precision in ("fp32", "int4"):
            row = report["engines"][engine][precision]
            if engine in ran and not (engine == "transformers" and precision == "int4"):
                assert "error" not in row, (engine, precision, row)
                assert all(row["decode"][p]["tok_s"] > 0 for p in ("32", "96")), row
                assert list(row["prefill"]) == ["0-32", "35-96"] and row["peak_rss_bytes"] > 2**20
            else:
                assert row["skipped"], (engine, precision, row)  # not installed / no source tree / no int4 path
    table = (tmp_path / "out" / "peers-quick-tiny.md").read_text()
    assert table.count("\n") == 2 + 8 and "| edgemem | int4 |" in table
    assert (tmp_path / "out" / "peers-quick-tiny.png").stat().st_size > 10_000
