"""kvsp's sampling rule inside vLLM: each row of the batch that carries ``kvsp_sampler`` gets
exactly the token kvsp's rule draws at its output step (its first step plus the tokens it has
produced), rows follow vLLM's moves and removals, and bad parameters are refused."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from kvsp.core.records import Sampler
from kvsp.instance.sampling import next_token
from kvsp.integrations.vllm.sampling import KvspSampling, sampling_args

SAMPLER = Sampler(method="top-k", params={"k": 5, "temperature": 0.9}, seed=3)


def params(first_step: int | None) -> SamplingParams:
    extra = None if first_step is None else sampling_args(SAMPLER, first_step)
    return SamplingParams(temperature=0.0, extra_args=extra)


def test_rows_get_the_token_of_their_step_and_follow_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    processor = KvspSampling(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    resumed_output: list[int] = [4, 4]  # a resumed request (step 10) with 2 tokens since
    added = [(0, params(0), None, []), (1, params(None), None, []), (2, params(10), None,
             resumed_output)]  # fmt: skip
    processor.update_state(BatchUpdate(3, [], added, []))
    out = processor.apply(logits.clone())
    assert torch.equal(out[1], logits[1])  # not kvsp-sampled: untouched
    for row, step in ((0, 0), (2, 12)):
        token = next_token(logits[row].numpy(), SAMPLER, step)
        assert int(out[row].argmax()) == token
        assert torch.isinf(out[row]).sum() == 49
    # row 2 moves to row 0 (row 0's request finished); its output grew meanwhile
    processor.update_state(BatchUpdate(2, [0], [], [(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    resumed_output.append(9)
    out = processor.apply(logits.clone())
    assert int(out[0].argmax()) == next_token(logits[0].numpy(), SAMPLER, 13)
    assert torch.equal(out[2], logits[2])


def test_bad_kvsp_sampler_parameters_are_refused() -> None:
    KvspSampling.validate_params(params(0))
    with pytest.raises(ValueError, match="temperature 0"):
        KvspSampling.validate_params(
            SamplingParams(temperature=0.5, extra_args=sampling_args(SAMPLER, 0))
        )
    bad = SamplingParams(temperature=0.0, extra_args={"kvsp_sampler": {"sampler": {}}})
    with pytest.raises(ValueError, match="kvsp_sampler"):
        KvspSampling.validate_params(bad)
