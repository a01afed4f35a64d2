"""Acceptance 5 of the server: lm-eval's local-completions against `baton serve` gives the same
per-item loglikelihoods as lm-eval's own `hf` model on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.bench.hf_export import export_hf_dir
from tests.server_util import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def _lm_eval(model: str, model_args: str, out: Path) -> dict[int, list[float]]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        "baton_mc",
        "--include_path",
        "tests/lm_eval",
        "--log_samples",
        "--output_path",
        str(out),
        "--batch_size",
        "1",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (samples,) = out.rglob("samples_baton_mc_*.jsonl")
    result = {}
    for line in samples.read_text().splitlines():
        item = json.loads(line)
        result[item["doc_id"]] = [float(r[0]) for r in item["filtered_resps"]]
    return result


@pytest.mark.slow  # 24 s; the default suite stays under its 12-minute budget
def test_lm_eval_local_completions_matches_hf(tmp_path):
    ref_dir = export_hf_dir("smollm2-135m")
    expected = _lm_eval("hf", f"pretrained={ref_dir},dtype=float32", tmp_path / "hf")
    # transformers runs the dequantized float32 weights
    server = ServerProcess("--quant-kernel", "float", "--kv-cache-dtype", "float32")
    try:
        got = _lm_eval(
            "local-completions",
            f"model=smollm2-135m,base_url={server.base_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={ref_dir},tokenized_requests=True,num_concurrent=1,max_retries=1",
            tmp_path / "baton",
        )
    finally:
        assert server.terminate() == 0
    assert sorted(got) == sorted(expected) and len(got) == 6
    for doc_id, lls in expected.items():
        assert len(got[doc_id]) == len(lls) == 4
        for a, b in zip(got[doc_id], lls):
            # float32 sums of several tokens' logprobs: relative 1e-5 (1e-4 absolute failed at 1.1e-4 on
            # a -21.5 sum with the landed code too: two float32 implementations, not a regression)
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (doc_id, got[doc_id], lls)
