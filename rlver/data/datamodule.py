"""LightningDataModule serving profiles for training, validation and test."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rlver.core.seeding import run_seed
from rlver.core.types import Profile
from rlver.data.profiles import load_profile_sets


class ProfileDataset(Dataset[Profile]):
    def __init__(self, profiles: Sequence[Profile]) -> None:
        self.profiles = list(profiles)

    def __len__(self) -> int:
        return len(self.profiles)

    def __getitem__(self, index: int) -> Profile:
        return self.profiles[index]


class ProfileBatch:
    """A batch of profiles: a plain sequence that Lightning's collection helpers leave alone.

    Precision plugins walk batches to cast tensors (FSDP's always does) and refuse frozen
    dataclasses such as `Profile`; this container is opaque to them, and holds no tensors.
    """

    __slots__ = ("profiles",)

    def __init__(self, profiles: Sequence[Profile]) -> None:
        self.profiles = list(profiles)

    def __len__(self) -> int:
        return len(self.profiles)

    def __iter__(self) -> Iterator[Profile]:
        return iter(self.profiles)

    def __getitem__(self, index: Any) -> Any:
        return self.profiles[index]


def _as_list(batch: list[Profile]) -> ProfileBatch:
    return ProfileBatch(batch)


# Lightning warns that a mid-epoch resume may train on other batches unless the loader is
# stateful; this sampler is indexed by the global step, so a resume is exact (tested).
warnings.filterwarnings(
    "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
)


class StepIndexedSampler(DistributedSampler):
    """This rank's profiles for training step s are a function of s alone.

    The rank's stream is its DistributedSampler share of epoch 0, then of epoch 1, ... (each
    shuffled by seed + epoch). A pass over the loader starts at the stream position of the
    trainer's global step, so a run resumed from any checkpoint (taken mid-epoch or at the
    end of training, which Lightning counts as a finished epoch) trains on exactly the
    profiles the uninterrupted run would have.
    """

    def __init__(
        self,
        dataset: Dataset[Profile],
        *,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        start: Callable[[], int] = lambda: 0,
    ) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
        self._start = start  # stream position (in profiles) of the next pass

    def __iter__(self) -> Iterator[int]:
        position = self._start()
        per_epoch = self.num_samples
        epoch, offset = divmod(position, per_epoch)
        remaining = per_epoch  # one pass is one epoch's worth, as len() says
        while remaining > 0:
            self.epoch = epoch  # DistributedSampler shuffles by seed + epoch
            share = list(super().__iter__())[offset : offset + remaining]
            yield from share
            remaining -= len(share)
            epoch, offset = epoch + 1, 0


class ProfileDataModule(L.LightningDataModule):
    """Profiles from JSONL files; a batch is a plain list of `Profile`.

    Args:
        train_files: Profile files for training (paths or `builtin:<set>`).
        val_files: Profile files for validation.
        test_files: Profile files for testing.
        batch_size: Profiles per batch on each rank; GRPO repeats each profile within the step.
        profiles_per_step: Training profiles per step across all ranks, split evenly over them
            (it must divide by the world size); it wins over `batch_size`. The paper's recipes
            set 32, so one node of 8 GPUs trains on 4 a GPU and 4 nodes on 1, the same step.
        shuffle: Shuffle training profiles each epoch (the order depends only on seed and epoch).
        limit: Use only the first N profiles of each split (0: all).
        train_limit: Train on only the first N training profiles (0: all), after `limit`. With
            N = steps x batch_size / passes, every pass shows the same users, so the training
            reward of one quarter of a run compares with another's on the same users.
        seed: Seed of the training order. None (the default): the run's seed (`--seed_everything`),
            so seeds of `rlver ablate` train on different users in a different order; a number
            pins the order whatever the run's seed.
    """

    def __init__(
        self,
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        test_files: list[str] | None = None,
        batch_size: int = 4,
        shuffle: bool = True,
        limit: int = 0,
        train_limit: int = 0,
        seed: int | None = None,
        profiles_per_step: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--data.batch_size ({batch_size}) must be >= 1")
        if profiles_per_step is not None and profiles_per_step < 1:
            raise ValueError(f"--data.profiles_per_step ({profiles_per_step}) must be >= 1")
        if limit < 0:
            raise ValueError(f"--data.limit ({limit}) must be >= 0")
        if train_limit < 0:
            raise ValueError(f"--data.train_limit ({train_limit}) must be >= 0")
        self.files = {
            "train": list(train_files if train_files is not None else ["builtin:en_train"]),
            "val": list(val_files if val_files is not None else ["builtin:en_test"]),
            "test": list(test_files if test_files is not None else ["builtin:en_test"]),
        }
        self.batch_size = batch_size
        self.profiles_per_step = profiles_per_step
        self.shuffle = shuffle
        self.limit = limit
        self.train_limit = train_limit
        self.seed = run_seed(seed)
        self._splits: dict[str, list[Profile]] = {}

    def profiles(self, split: str) -> list[Profile]:
        """The profiles of one split ("train", "val" or "test"), loaded once."""
        if split not in self.files:
            raise ValueError(f"unknown split {split!r}; splits: train, val, test")
        if split not in self._splits:
            loaded = load_profile_sets(self.files[split])
            loaded = loaded[: self.limit] if self.limit else loaded
            if split == "train" and self.train_limit:
                loaded = loaded[: self.train_limit]
            self._splits[split] = loaded
        return self._splits[split]

    def setup(self, stage: str | None = None) -> None:
        if self.profiles_per_step is not None:
            world = self.trainer.world_size if self.trainer is not None else 1
            self.batch_size = profiles_per_rank(self.profiles_per_step, world)
        wanted = {"fit": ["train", "val"], "validate": ["val"], "test": ["test"]}.get(
            stage or "", list(self.files)
        )
        for split in wanted:
            self.profiles(split)

    def _loader(self, split: str, shuffle: bool) -> DataLoader[Profile]:
        return DataLoader(
            ProfileDataset(self.profiles(split)),
            batch_size=self.batch_size,
            shuffle=shuffle,
            collate_fn=_as_list,
        )

    def train_dataloader(self) -> DataLoader[Profile]:
        trainer = self.trainer
        dataset = ProfileDataset(self.profiles("train"))
        batch_size = self.batch_size
        sampler = self._train_sampler(dataset, lambda: trainer.global_step if trainer is not None else 0)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=_as_list)

    def train_batch_at(self, step: int) -> list[Profile]:
        """This rank's training profiles for `step`: what the loader yields at that step (the
        overlapped rollout starts the next step's dialogues before the loader gets there)."""
        dataset = ProfileDataset(self.profiles("train"))
        indices = iter(self._train_sampler(dataset, lambda: step))
        return [dataset[i] for _, i in zip(range(self.batch_size), indices, strict=False)]

    def _train_sampler(self, dataset: Dataset[Profile], step: Callable[[], int]) -> StepIndexedSampler:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        batch_size = self.batch_size
        return StepIndexedSampler(
            dataset, rank=rank, world_size=world, shuffle=self.shuffle, seed=self.seed,
            start=lambda: step() * batch_size,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader[Profile]:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader[Profile]:
        return self._loader("test", False)


def profiles_per_rank(profiles_per_step: int, world_size: int) -> int:
    """Each rank's share of a step's profiles; a share that is not whole is refused."""
    if profiles_per_step % world_size:
        raise ValueError(
            f"--data.profiles_per_step ({profiles_per_step}) must divide by the world size "
            f"({world_size}: --trainer.devices x --trainer.num_nodes)"
        )
    return profiles_per_step // world_size
