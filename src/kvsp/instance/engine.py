"""The engine: SmolLM2 through HF transformers and torch on the CPU, with a KV cache that can
leave and enter as KVB1 containers.

A sequence's KV cache is a ``KvState``: the transformers cache plus the tokens it covers. Blocks
of ``block_tokens`` tokens are exported as containers in kvsp-layout-1 (per layer, K then V,
each ``[tokens, kv_heads, head_dim]`` float32 little-endian) and imported back into a state;
the round trip is bit-exact, so an engine that imports another's blocks continues with logits
identical to the exporter's own continuation. Calls are synchronous and not thread-safe: an
adapter runs one engine on one worker thread so the event loop never waits on a forward pass.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvsp.core.container import Container, section_array
from kvsp.core.problems import ContainerError
from kvsp.core.records import Sampler
from kvsp.instance.attention import GROUPED_SDPA
from kvsp.instance.growing_cache import GrowingCache, GrowingLayer, room_for
from kvsp.instance.sampling import next_token
from kvsp.model import ModelFiles

__all__ = ["Engine", "KvState", "PrefixImport"]


@dataclass
class KvState:
    """The KV cache of one sequence (its layers grow in place: ``growing_cache.py``) and the
    tokens it covers."""

    cache: GrowingCache = field(default_factory=GrowingCache)
    tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


class Engine:
    def __init__(self, files: ModelFiles, threads: int | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if threads is not None:
            torch.set_num_threads(threads)
        self.descriptor = files.descriptor
        self.geometry = files.descriptor.geometry
        self.block_tokens = files.descriptor.block_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(files.weights)
        self.model = AutoModelForCausalLM.from_pretrained(
            files.weights, dtype=torch.float32, attn_implementation=GROUPED_SDPA
        )
        self.model.eval()  # type: ignore[no-untyped-call]
        eos = self.tokenizer.eos_token_id
        self.stop_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    @functools.cached_property
    def identity(self) -> str:
        """What decides this engine's output bits from a given state: kvsp (its sampler), the
        libraries, the device, the element type and the threads torch splits work over (a
        different split can round differently). Instances with equal identities resume each
        other's deterministic sessions (KVSP 4.4)."""
        import transformers

        from kvsp import __version__

        return (
            f"kvsp {__version__}; transformers {transformers.__version__}; "
            f"torch {torch.__version__}; cpu float32; threads {torch.get_num_threads()}"
        )

    # -- forward passes ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, state: KvState, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """Run ``tokens`` after what ``state`` covers (extending it); the logits of the last
        (the only ones computed: the vocabulary's projection of every other token was 6-10 %
        of a 2,048-token prefill)."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = self.model(ids, past_key_values=state.cache, use_cache=True, logits_to_keep=1)
        state.tokens.extend(tokens)
        logits: npt.NDArray[np.float32] = out.logits[0, -1].float().numpy().copy()
        return logits

    def generate(
        self,
        state: KvState,
        prompt_rest: Sequence[int],
        sampler: Sampler,
        max_new_tokens: int,
        first_step: int = 0,
    ) -> Iterator[int]:
        """Tokens after ``state`` + ``prompt_rest``, one at a time; step numbers start at
        ``first_step`` (a resumed session continues its count). Stops at end of sequence."""
        if not prompt_rest:
            raise ValueError("at least the last prompt token must be computed here")
        logits = self.forward(state, prompt_rest)
        for step in range(first_step, first_step + max_new_tokens):
            token = next_token(logits, sampler, step)
            yield token
            if token in self.stop_ids:
                return
            logits = self.forward(state, [token])

    # -- blocks ------------------------------------------------------------------------------

    def export_block(self, state: KvState, index: int) -> Container:
        """Block ``index`` of ``state`` (tokens ``index*B .. (index+1)*B``) as a container."""
        b = self.block_tokens
        return self.export_range(state, index * b, (index + 1) * b)

    def export_range(self, state: KvState, lo: int, hi: int) -> Container:
        """Tokens ``lo..hi-1`` of ``state``, every layer, as a container."""
        if not 0 <= lo < hi <= len(state):
            raise ValueError(f"tokens {lo}-{hi} are not all cached ({len(state)} are)")
        sections = []
        for layer in state.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise ValueError("the cache holds no attention keys and values")
            k = keys[0, :, lo:hi, :].permute(1, 0, 2).contiguous().numpy()
            v = values[0, :, lo:hi, :].permute(1, 0, 2).contiguous().numpy()
            sections.append((k, v))
        return Container.build(0, hi - lo, sections, geometry=self.geometry)

    def prefix(self, tokens: int) -> PrefixImport:
        """Room for a sequence of ``tokens`` tokens (and those generated after), to be filled
        with an imported prefix block by block as the blocks arrive."""
        return PrefixImport(self, tokens)

    def state_from_blocks(self, blocks: Sequence[Container], tokens: Sequence[int]) -> KvState:
        """A state covering ``tokens`` from the containers of its consecutive blocks."""
        if len(tokens) != len(blocks) * self.block_tokens:
            raise ValueError("tokens must be exactly the tokens of the blocks")
        prefix = self.prefix(len(tokens))
        for index, block in enumerate(blocks):
            prefix.add(index, block)
        return prefix.state(tokens)


class PrefixImport:
    """The cache buffers of one sequence, filled with the blocks of an imported prefix as they
    arrive, then made its state.

    Each block's sections are copied once, transposed, straight into the layers' buffers, which
    have room for the whole sequence (``growing_cache.py``): the forwards after write only their
    own tokens. Joined into one array first, whose transposed views the cache held, the next
    forward copied the whole prefix again (decision 0028). A block copied as it arrives overlaps
    the fetches of the blocks after it: for a 2,048-token prefix fetched from another holder,
    copying all 127 after the last had arrived added about 27 ms to the time to first token
    (decision 0029). ``add`` may run on any one thread at a time; blocks land in disjoint parts.
    """

    def __init__(self, engine: Engine, tokens: int) -> None:
        g = engine.geometry
        self._engine = engine
        self._blocks = tokens // engine.block_tokens
        self._added = [False] * self._blocks
        # [layers, K and V, kv_heads, capacity, head_dim]
        self._rooms = np.empty(
            (g.layers, 2, g.kv_heads, room_for(tokens), g.head_dim),
            np.dtype(g.element.storage_dtype),
        )

    def add(self, index: int, block: Container) -> None:
        """Block ``index`` of the prefix (a verified container of every layer)."""
        engine, b = self._engine, self._engine.block_tokens
        if not 0 <= index < self._blocks:
            raise ValueError(f"block {index} is not within the {self._blocks} blocks made room for")
        header = block.header
        if header.first_layer != 0 or header.layer_count != engine.geometry.layers:
            raise ContainerError("an imported block must hold every layer")
        if header.token_count != b:
            raise ContainerError(f"an imported block must hold {b} tokens")
        # [layers, K and V, tokens, kv_heads, head_dim] into [..., kv_heads, tokens, head_dim]
        sections = self._sections_of(block).transpose(0, 1, 3, 2, 4)
        self._rooms[:, :, :, index * b : (index + 1) * b] = sections
        self._added[index] = True

    def state(self, tokens: Sequence[int]) -> KvState:
        """The state covering ``tokens``: the tokens of the first blocks, every one added."""
        blocks, rest = divmod(len(tokens), self._engine.block_tokens)
        if rest or blocks > self._blocks or not all(self._added[:blocks]):
            raise ValueError("tokens must be exactly the tokens of the first blocks added")
        layers = []
        for index in range(self._engine.geometry.layers):
            layer = GrowingLayer()
            layer.adopt(
                torch.from_numpy(self._rooms[index, 0]).unsqueeze(0),
                torch.from_numpy(self._rooms[index, 1]).unsqueeze(0),
                len(tokens),
            )
            layers.append(layer)
        return KvState(GrowingCache(layers), list(tokens))

    def _sections_of(self, block: Container) -> npt.NDArray[np.generic]:
        """A block's sections as one [layers, 2, tokens, kv_heads, head_dim] array: its data
        (every section the same length, K before V, layer by layer; a received container's is
        a view), else a copy of its sections."""
        g = self._engine.geometry
        dtype = np.dtype(g.element.storage_dtype)
        shape = (g.layers, 2, self._engine.block_tokens, g.kv_heads, g.head_dim)
        section = self._engine.block_tokens * g.kv_heads * g.head_dim * dtype.itemsize
        if set(block.header.lengths) == {(section, section)}:
            return np.frombuffer(block.data(), dtype).reshape(shape)
        return np.stack(
            [
                np.stack(
                    [
                        section_array(layer.k, g.element, g.kv_heads, g.head_dim),
                        section_array(layer.v, g.element, g.kv_heads, g.head_dim),
                    ]
                )
                for layer in block.layers
            ]
        )
