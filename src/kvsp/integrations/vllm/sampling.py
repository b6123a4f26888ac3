"""kvsp's sampling rule inside vLLM, so that a sampled session resumes token for token.

vLLM's seeded sampling keeps a random generator per request: a request started anew on another
instance cannot continue its predecessor's draws, so only greedy sessions resumed exactly.
kvsp's rule (``kvsp.instance.sampling``) draws step n from (seed, n) alone. This logits
processor applies that rule to vLLM's logits for every request whose ``extra_args`` carry
``kvsp_sampler`` (the Sampler, and the output step its first token has): it leaves only the
chosen token possible, and vLLM, run greedy for such requests, takes it. A request resumed at
step n draws exactly what the failed instance would have, given the same logits (the
determinism rule: engines that are bit-identical give bit-identical logits).

Register it with ``logits_processors=[KvspSampling]`` (the vLLM-backed instance does) or
``vllm serve --logits-processors kvsp.integrations.vllm.sampling:KvspSampling``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from kvsp.core.records import Sampler
from kvsp.instance.sampling import next_token

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

__all__ = ["KvspSampling", "sampling_args"]

_KEY = "kvsp_sampler"


def sampling_args(sampler: Sampler, first_step: int) -> dict[str, Any]:
    """The ``extra_args`` entry of a request sampled by kvsp's rule from ``first_step`` on."""
    return {_KEY: {"sampler": sampler.model_dump(mode="json"), "first_step": first_step}}


def _spec(params: SamplingParams) -> tuple[Sampler, int] | None:
    spec = (params.extra_args or {}).get(_KEY)
    if spec is None:
        return None
    sampler = Sampler.model_validate(spec["sampler"])
    first = spec["first_step"]
    if not isinstance(first, int) or first < 0:
        raise ValueError("kvsp_sampler.first_step must be an integer >= 0")
    if params.temperature != 0.0:
        raise ValueError("a request sampled by kvsp's rule runs with temperature 0")
    return sampler, first


class KvspSampling(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        #: batch row -> (sampler, step of the request's first output, its output so far)
        self._rows: dict[int, tuple[Sampler, int, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            _spec(sampling_params)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"kvsp_sampler: {exc}") from exc

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, for requests vLLM samples greedily

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def row(
            params: SamplingParams, prompt: list[int] | None, output: list[int]
        ) -> tuple[Sampler, int, list[int]] | None:
            spec = _spec(params)
            return None if spec is None else (spec[0], spec[1], output)

        process_dict_updates(self._rows, batch_update, row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (sampler, first, output) in self._rows.items():
            values = logits[index]
            token = next_token(values.float().cpu().numpy(), sampler, first + len(output))
            values.fill_(float("-inf"))
            values[token] = 0.0
        return logits
