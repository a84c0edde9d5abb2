"""From finished dialogues to training tensors.

Training samples are the packed token sequences of the dialogues (one per
dialogue in the non-thinking format, one per turn in the thinking format).
Advantages are computed on per-dialogue *timelines*: the dialogue's
policy-sampled tokens in order across all its sequences. `timeline_seq` and
`timeline_pos` say where each timeline position lives in the sequence tensors,
so values can be gathered from, and advantages scattered back to, sequences.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from rlver.core.trajectory import Trajectory

# Vocabulary-wide rows of float32 work alive at once in the log-prob and entropy maths
# (`in_vocab_chunks` below, recomputed in the backward): at Qwen2.5's 152,064 words 1,024 rows
# are 0.6 GB per float32 temporary, however many positions a micro-batch holds (a paper
# micro-batch, 2 x 8,192 positions, would be 9.3 GB per temporary in one pass).
VOCAB_ROWS_PER_CHUNK = 1024
# rlver.plan.memory_plan reads it from here to size that work.


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # (S, L) right-padded
    attention_mask: torch.Tensor  # (S, L)
    loss_mask: torch.Tensor  # (S, L) 1 on policy-sampled tokens
    engine_logprobs: torch.Tensor  # (S, L) the engine's log-probs, 0 off the mask
    sequence_dialogue: torch.Tensor  # (S,) which dialogue each sequence belongs to
    timeline_seq: torch.Tensor  # (D, T) sequence index of each timeline position
    timeline_pos: torch.Tensor  # (D, T) position within that sequence
    timeline_mask: torch.Tensor  # (D, T) 1 on real timeline positions
    timeline_turn: torch.Tensor  # (D, T) the policy turn (0-based) each timeline position belongs to

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def to_timeline(self, per_token: torch.Tensor) -> torch.Tensor:
        """Gather a (S, L) tensor into (D, T) timelines (0 on padding)."""
        return per_token[self.timeline_seq, self.timeline_pos] * self.timeline_mask.to(per_token.dtype)

    def to_sequences(self, timeline: torch.Tensor) -> torch.Tensor:
        """Scatter a (D, T) timeline tensor back to (S, L) (0 off the loss mask)."""
        out = torch.zeros(self.input_ids.shape, dtype=timeline.dtype, device=timeline.device)
        real = self.timeline_mask.bool()
        out[self.timeline_seq[real], self.timeline_pos[real]] = timeline[real]
        return out

    def to(self, device: torch.device | str) -> RolloutBatch:
        return RolloutBatch(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


def build_batch(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutBatch:
    sequences = []
    owners = []
    for dialogue, trajectory in enumerate(trajectories):
        for sequence in trajectory.sequences:
            sequences.append(sequence)
            owners.append(dialogue)
    if not sequences:
        raise ValueError("no policy tokens to train on")
    width = max(len(s) for s in sequences)
    count = len(sequences)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((count, width), dtype=torch.long)
    loss_mask = torch.zeros((count, width), dtype=torch.long)
    engine_logprobs = torch.zeros((count, width), dtype=torch.float32)
    timelines: list[list[tuple[int, int, int]]] = [[] for _ in trajectories]
    for index, (sequence, owner) in enumerate(zip(sequences, owners, strict=True)):
        length = len(sequence)
        input_ids[index, :length] = torch.tensor(sequence.input_ids)
        attention_mask[index, :length] = 1
        loss_mask[index, :length] = torch.tensor(sequence.loss_mask)
        engine_logprobs[index, :length] = torch.tensor(sequence.old_logprobs)
        for turn, start, end in sequence.turn_spans:  # a turn's reply: policy-sampled throughout
            timelines[owner].extend((index, p, turn) for p in range(start, end))
    horizon = max(len(t) for t in timelines)
    timeline_seq = torch.zeros((len(trajectories), horizon), dtype=torch.long)
    timeline_pos = torch.zeros((len(trajectories), horizon), dtype=torch.long)
    timeline_mask = torch.zeros((len(trajectories), horizon), dtype=torch.long)
    timeline_turn = torch.zeros((len(trajectories), horizon), dtype=torch.long)
    for dialogue, timeline in enumerate(timelines):
        if not timeline:
            raise ValueError(
                f"dialogue {dialogue} ({trajectories[dialogue].profile.id}) has no policy tokens"
            )
        columns = torch.tensor(timeline).T
        timeline_seq[dialogue, : len(timeline)] = columns[0]
        timeline_pos[dialogue, : len(timeline)] = columns[1]
        timeline_turn[dialogue, : len(timeline)] = columns[2]
        timeline_mask[dialogue, : len(timeline)] = 1
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        engine_logprobs=engine_logprobs,
        sequence_dialogue=torch.tensor(owners, dtype=torch.long),
        timeline_seq=timeline_seq,
        timeline_pos=timeline_pos,
        timeline_mask=timeline_mask,
        timeline_turn=timeline_turn,
    )


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(S, L) log-prob of each token given the ones before it (position 0 gets 0).

    Uses logits / temperature, matching what the engines report for sampled tokens.
    """
    picked = target_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    return torch.nn.functional.pad(picked, (1, 0))


def in_vocab_chunks(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, *aligned: torch.Tensor, dim: int, **options: Any
) -> torch.Tensor:
    """`fn(logits_part, *aligned_parts, **options)` over slices of `logits` (and of the tensors
    aligned with it) along `dim`, each slice at most VOCAB_ROWS_PER_CHUNK rows of the vocabulary,
    the results concatenated along `dim`.

    `fn` casts to float32 and reduces over the vocabulary; only one slice's float32 copy and
    temporaries are alive at a time. Under autograd each slice is recomputed in the backward
    (torch.utils.checkpoint) instead of keeping its float32 copy for it, so the saved state is the
    logits alone, in their own dtype. `torch.split`'s backward assembles the slices' gradients
    into one logits-sized tensor once (slicing by index would allocate one per slice).
    """
    rows_per_index = math.prod(logits.shape[:dim])
    step = max(1, VOCAB_ROWS_PER_CHUNK // max(1, rows_per_index))
    recompute = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for parts in zip(logits.split(step, dim=dim), *(t.split(step, dim=dim) for t in aligned), strict=True):
        if recompute:
            pieces.append(
                torch.utils.checkpoint.checkpoint(
                    fn, *parts, use_reentrant=False, preserve_rng_state=False, **options
                )
            )  # nothing random to replay
        else:
            pieces.append(fn(*parts, **options))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / temperature, the distribution the engines sample from (0 or 1: as they are)."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def _picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = tempered(logits, temperature)
    # gather - logsumexp avoids materialising a second (S, K, V) tensor of log-probs.
    return logits.gather(2, targets[..., None]).squeeze(2) - torch.logsumexp(logits, dim=-1)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(S, K) float32 log-prob of `targets` under softmax(logits / temperature), logits (S, K, V),
    computed over chunks of positions (`in_vocab_chunks`)."""
    return in_vocab_chunks(_picked_logprobs, logits, targets, dim=1, temperature=temperature)


def placeholder_batch(pad_id: int) -> RolloutBatch:
    """A one-sequence batch with nothing to learn (every loss mask 0).

    A rank whose dialogues all ended before the policy spoke still has to run the
    step's collectives (advantage statistics, gradient all-reduces) with the others;
    it does so on this batch, whose dialogue is marked invalid.
    """
    ids = torch.full((1, 2), pad_id, dtype=torch.long)
    zeros = torch.zeros((1, 2), dtype=torch.long)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        loss_mask=zeros,
        engine_logprobs=torch.zeros((1, 2), dtype=torch.float32),
        sequence_dialogue=torch.zeros(1, dtype=torch.long),
        timeline_seq=torch.zeros((1, 1), dtype=torch.long),
        timeline_pos=torch.ones((1, 1), dtype=torch.long),
        timeline_mask=torch.ones((1, 1), dtype=torch.long),
        timeline_turn=torch.zeros((1, 1), dtype=torch.long),
    )


def micro_batches(rows: Sequence[int] | range, size: int) -> Iterator[list[int]]:
    """`rows` in consecutive slices of at most `size` (the last may be shorter)."""
    rows = list(rows)
    for start in range(0, len(rows), size):
        yield rows[start : start + size]
