"""Batched generation with transformers: left padding, KV cache, exact log-probs.

The engine samples from the very module being trained, so there is no weight
sync. Log-probs are recorded during generation by a logits processor that sits
before HF's temperature/top-p warpers: at step t it stores
log_softmax(logits / T) and, one step later, reads off the log-prob of the
token that was actually sampled. Memory stays O(batch x vocab). Prompts that occur
more than once in a call (a GRPO group's first turn) are prefilled once each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rlver.core.interfaces import Generation, RolloutEngine, SamplingSettings
from rlver.modeling.loss_positions import accepts_logits_to_keep
from rlver.modeling.models import Policy
from rlver.modeling.shared_prefix import plain_cache, sharable


class _SampledLogprobRecorder(LogitsProcessor):
    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self._pending: torch.Tensor | None = None  # log-probs of the step whose token is not yet known
        self.steps: list[torch.Tensor] = []  # (batch,) log-prob of each sampled token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take_sampled(input_ids[:, -1])
        logits = scores.float()
        if self.temperature > 0:
            logits = logits / self.temperature
        self._pending = torch.log_softmax(logits, dim=-1)
        return scores

    def _take_sampled(self, tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self.steps.append(self._pending.gather(1, tokens[:, None]).squeeze(1))
            self._pending = None

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(batch, new_tokens) log-probs, once generation has returned."""
        self._take_sampled(last_tokens)
        return torch.stack(self.steps, dim=1)


class _SeededRowSampler(LogitsProcessor):
    """Samples each row with a generator of its own (softmax(logits / T), top-p), so a prompt's
    sample does not depend on the other prompts of the call; generate() then decodes greedily,
    and the only finite score left in a row is the token sampled here."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, device: torch.device) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            # nucleus: the most likely tokens whose mass before them is below top_p (at least one)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(mass_before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        chosen = torch.stack(
            [torch.multinomial(row, 1, generator=g) for row, g in zip(probs, self.generators, strict=True)]
        )
        return torch.full_like(scores, float("-inf")).scatter(-1, chosen, 0.0)


class HFEngine(RolloutEngine):
    """Rollouts with transformers `generate` on the policy module itself.

    Args:
        batch_size: Most prompts in one `generate` call; larger batches are split.
        sort_by_length: Group prompts of similar length into the same call to save padding.
    """

    samples_from_training_module = True

    def __init__(self, policy: Policy, batch_size: int = 16, sort_by_length: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1")
        self.policy = policy
        self.batch_size = batch_size
        self.sort_by_length = sort_by_length
        self.stop_ids = policy.stop_token_ids
        pad = policy.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        order = list(range(len(prompts)))
        if self.sort_by_length:
            order.sort(key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        seeds = sampling.prompt_seeds
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} prompt seeds for {len(prompts)} prompts")
        for chunk_index, start in enumerate(range(0, len(order), self.batch_size)):
            chunk = order[start : start + self.batch_size]
            # Each chunk gets its own seed so results do not depend on how many chunks ran before.
            chunk_seed = sampling.seed * 1_000_003 + chunk_index
            row_seeds = None if seeds is None else [seeds[i] for i in chunk]
            chunk_prompts = [prompts[i] for i in chunk]
            generations = self._generate_chunk(chunk_prompts, sampling, chunk_seed, row_seeds)
            for index, generation in zip(chunk, generations, strict=True):
                results[index] = generation
        return [r for r in results if r is not None]

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: list[Sequence[int]], sampling: SamplingSettings, seed: int, row_seeds: list[int] | None
    ) -> list[Generation]:
        # Under FSDP1 the policy is a wrapper around the HF model: generate on the model itself,
        # so its generation_config is the one swapped below (the trainer has gathered the weights).
        model = getattr(self.policy.model, "module", self.policy.model)
        device = self.policy.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        greedy = sampling.temperature == 0
        processors: list[LogitsProcessor] = [_SampledLogprobRecorder(sampling.temperature)]
        if not greedy and row_seeds is not None:
            processors.append(_SeededRowSampler(row_seeds, sampling.temperature, sampling.top_p, device))
            greedy = True  # generate() takes the row sampler's choice
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else 0,  # 0 disables top-k; None would become transformers' default 50
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
        )
        recorder = processors[0]
        was_training = model.training
        model_config = model.generation_config
        # generate() fills every unset field of `config` from model.generation_config (a
        # Qwen2.5-Instruct file brings top_k=20, repetition_penalty=1.05, ...), and a penalty
        # would even act before the recorder. With `config` standing in for the model's, only
        # transformers' neutral defaults fill the gaps: plain softmax(logits / T), top-p if < 1.
        model.generation_config = config
        model.eval()
        devices = [device.index or 0] if device.type == "cuda" else []
        try:
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            cache = {"past_key_values": _prefill_distinct(model, input_ids, attention_mask)}
            if cache["past_key_values"] is None:
                cache = {}
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=config,
                    **cache,
                    logits_processor=LogitsProcessorList(processors),
                    # Under FSDP generate() would sync ranks every token; the trainer gathers the
                    # weights for the rollout instead, so ranks generate independently.
                    synced_gpus=False,
                )
        finally:
            model.generation_config = model_config
            model.train(was_training)
        new_tokens = output[:, width:].cpu()
        logprobs = recorder.finish(output[:, -1]).cpu()
        return [self._trim(new_tokens[row], logprobs[row]) for row in range(len(prompts))]

    def _trim(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> Generation:
        ids = tokens.tolist()
        for position, token in enumerate(ids):
            if token in self.stop_ids:
                end = position + 1
                return Generation(tuple(ids[:end]), tuple(logprobs[:end].tolist()), "stop")
        return Generation(tuple(ids), tuple(logprobs.tolist()), "length")


def _prefill_distinct(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """The KV cache of the left-padded prompts but their last token, each distinct prompt run
    once: a GRPO group's members open with the same prompt, so a first turn's prefill shrinks by
    the group size. None when every prompt differs or the model's cache cannot be shared
    (`rlver.modeling.shared_prefix`); generate() then prefills as usual. Positions as generate() derives
    them from the attention mask."""
    rows, width = input_ids.shape
    if width < 2 or not sharable(model):
        return None
    distinct, owner = torch.unique(torch.cat((input_ids, attention_mask), dim=1), dim=0, return_inverse=True)
    if distinct.shape[0] == rows:
        return None
    ids, mask = distinct[:, : width - 1], distinct[:, width : 2 * width - 1]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    no_logits = {"logits_to_keep": torch.zeros(0, dtype=torch.long, device=ids.device)}
    cache = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
        **(no_logits if accepts_logits_to_keep(model) else {}),
    ).past_key_values  # fmt: skip
    if not plain_cache(model, cache):
        return None
    cache.batch_select_indices(owner)
    return cache
