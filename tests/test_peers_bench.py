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
        [
            sys.executable,
            str(ROOT / "benchmarks" / "peers.py"),
            "--config",
            "tiny",
            "--quick",
            "--positions",
            "32,96",
            "--steps",
            "3",
            "--threads",
            "1",
            "--cache",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "peers-quick-tiny.json").read_text())
    assert report["positions"] == [32, 96] and report["machine"]["copy_bandwidth_GBps"] > 0
    floor = report["floor"]
    assert 0 < floor["int4"]["weight_bytes"] < floor["fp32"]["weight_bytes"]
    ran = {"edgemem", "edgemem-growing"} | {
        e for e, m in (("genai", "onnxruntime_genai"), ("transformers", "transformers")) if importlib.util.find_spec(m)
    }
    for engine in ("edgemem", "edgemem-growing", "genai", "llama.cpp", "transformers"):
        for precision in ("fp32", "int4"):
            row = report["engines"][engine][precision]
            if engine in ran and not (engine == "transformers" and precision == "int4"):
                assert "error" not in row, (engine, precision, row)
                assert all(row["decode"][p]["tok_s"] > 0 for p in ("32", "96")), row
                assert row["peak_rss_bytes"] > 2**20 and row["graph"]
                if engine == "transformers":  # the later position is reached by filling its cache with random rows
                    assert list(row["prefill"]) == ["0-32"] and row["filled"] == ["35-96"]
                else:
                    assert list(row["prefill"]) == ["0-32", "35-96"] and "filled" not in row
            else:
                assert row["skipped"], (engine, precision, row)  # not installed / no source tree / no int4 path
    table = (tmp_path / "out" / "peers-quick-tiny.md").read_text()
    assert table.count("\n") == 2 + 10 and "| edgemem | int4 |" in table and "| edgemem-growing | fp32 |" in table
    assert report["kv_cache_length"] == 128  # 96 + 2 × 3 decoded + 16, rounded up to a power of two
    assert (tmp_path / "cache" / "edgemem-fp32-cache128" / "edgemem.json").is_file()
    assert (tmp_path / "out" / "peers-quick-tiny.png").stat().st_size > 10_000


def _peers():
    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transformers_fill_brings_every_attention_cache_to_the_position_and_decoding_goes_on(tmp_path):
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    import torch
    from transformers.cache_utils import DynamicLayer

    peers = _peers()
    runner = peers.TransformersRunner(peers.make_model(tmp_path, "tiny"), threads=1, max_len=64)
    runner.prefill([5, 9, 12, 7, 3, 2, 8, 4])

    def linear_states():
        return [t.clone() for layer in runner.cache.layers for t in getattr(layer, "recurrent_states", {}).values()]

    linear = linear_states()
    runner.fill(20)
    assert runner.cache.get_seq_length() == 28
    attention = [layer for layer in runner.cache.layers if isinstance(layer, DynamicLayer)]
    assert attention and all(layer.keys.shape[-2] == layer.values.shape[-2] == 28 for layer in attention)
    assert linear and all(
        torch.equal(a, b) for a, b in zip(linear, linear_states())
    )  # fixed-size states are left alone
    runner.step(11)
    assert runner.cache.get_seq_length() == 29


def test_the_preallocated_cache_covers_the_whole_stream():
    peers = _peers()
    assert peers.stream_length([1024, 16384], 32) == 16384 + 64 + 16
    assert peers.cache_length([1024, 16384], 32) == 32768
    assert peers.cache_length([32, 96], 3) == 128 and peers.cache_length([16], 1) == 64
