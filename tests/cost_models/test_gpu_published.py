"""The published results the GPU fidelity benchmark compares with: every row sourced and known."""

from __future__ import annotations

import json

from benchmarks.gpu_fidelity import (
    DATA,
    RESULTS,
    published_batches_fit,
    readme_block,
)
from cost_models.devices.catalog import get_device_type
from cost_models.estimate.precision import policy_from_keras


def test_every_published_row_has_its_source_conditions_and_a_known_device() -> None:
    data = json.loads(DATA.read_text(encoding="utf-8"))
    rows = data["throughput"]
    assert {r["role"] for r in rows} == {"calibration", "validation"}
    for row in [*rows, *data["all_reduce"]]:
        assert row["source"].startswith("https://") and row["conditions"], row["id"]
        get_device_type(row["device"])
    for row in rows:
        assert row["published_samples_per_s"] > 0 and row["batch_size"] > 0
        assert row["precision"] in ("float32", "mixed_float16", "mixed_bfloat16")
        policy_from_keras(row["precision"])
    assert len({r["id"] for r in rows}) == len(rows)


def test_the_readme_block_renders_from_the_results() -> None:
    block = readme_block(RESULTS)
    assert "| resnet50 | a100-40gb | tf32 | 256 | 909 |" in block
    assert "calibration:" in block and "validation:" in block


def test_no_configuration_is_both_calibration_and_validation() -> None:
    rows = json.loads(DATA.read_text(encoding="utf-8"))["throughput"]
    keys = {
        role: {
            (r["model"], r["batch_size"], r["precision"], r["device"])
            for r in rows
            if r["role"] == role
        }
        for role in ("calibration", "validation")
    }
    assert not keys["calibration"] & keys["validation"]
    # the BERT-large pretraining rows at sequence length 128 are validation only
    assert all(r["role"] == "validation" for r in rows if r["model"] == "bert_large")


def test_published_batches_that_do_not_fit_are_named() -> None:
    rows = [
        {"id": "bert-a", "model": "bert_large", "fits": True},
        {"id": "bert-b", "model": "bert_large_seq512", "fits": False},
        {"id": "cnn", "model": "resnet50", "fits": False},
    ]
    assert published_batches_fit({"throughput": rows}) == (["bert-b"], ["cnn"])
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    bert_over, _ = published_batches_fit(results)
    assert bert_over == []  # NVIDIA trained each BERT row at its batch on one GPU
