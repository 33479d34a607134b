"""The plug-in's metric labels: bounded whatever a client sends."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the plug-in's stats need vllm")

from kvconnect.core.errors import InvalidRequestError, LeaseLostError  # noqa: E402
from kvconnect.vllm.stats import failure_reason  # noqa: E402


def test_a_failure_reason_names_the_field_without_the_clients_list_index() -> None:
    """`remote_block_ids[100]` made one `reason` label value per index a client chose."""
    reasons = {
        failure_reason(InvalidRequestError(f"kv_transfer_params.remote_block_ids[{i}]", "bad")) for i in range(100)
    }
    assert reasons == {"InvalidRequestError(kv_transfer_params.remote_block_ids)"}
    assert failure_reason(InvalidRequestError("x" * 1000, "long")) == f"InvalidRequestError({'x' * 64})"
    assert failure_reason(LeaseLostError("gone")) == "LeaseLostError"


def test_a_params_field_is_one_label_whichever_check_refused_it() -> None:
    """The decode's plan refuses `remote_block_ids` by its bare name (8 remote blocks for 9 local ones), the
    params' own checks as `kv_transfer_params.remote_block_ids`: one client error counted under two labels (a CI
    failure of test_vllm's edited-block-ids test, once the tiny tokenizer gave its two prompts different block
    counts)."""
    bare = failure_reason(InvalidRequestError("remote_block_ids", "8 remote blocks for 9 local blocks"))
    named = failure_reason(InvalidRequestError("kv_transfer_params.remote_block_ids", "bad"))
    assert bare == named == "InvalidRequestError(kv_transfer_params.remote_block_ids)"
    assert failure_reason(InvalidRequestError("local_block_ids", "bad")) == "InvalidRequestError(local_block_ids)"
