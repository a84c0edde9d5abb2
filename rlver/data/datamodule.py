"""LightningDataModule serving profiles for training, validation and test."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
from torch.utils.data import DataLoader, Dataset

from rlver.data.profiles import load_profile_sets
from rlver.types import Profile


class ProfileDataset(Dataset[Profile]):
    def __init__(self, profiles: Sequence[Profile]) -> None:
        self.profiles = list(profiles)

    def __len__(self) -> int:
        return len(self.profiles)

    def __getitem__(self, index: int) -> Profile:
        return self.profiles[index]


def _as_list(batch: list[Profile]) -> list[Profile]:
    return batch


class ProfileDataModule(L.LightningDataModule):
    """Profiles from JSONL files; a batch is a plain list of `Profile`.

    Args:
        train_files: Profile files for training (paths or `builtin:<set>`).
        val_files: Profile files for validation.
        test_files: Profile files for testing.
        batch_size: Dialogues (profiles) per batch; GRPO repeats each profile within the step.
        shuffle: Shuffle training profiles each epoch.
        limit: Use only the first N profiles of each split (0: all).
    """

    def __init__(
        self,
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        test_files: list[str] | None = None,
        batch_size: int = 4,
        shuffle: bool = True,
        limit: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--data.batch_size ({batch_size}) must be >= 1")
        if limit < 0:
            raise ValueError(f"--data.limit ({limit}) must be >= 0")
        self.files = {
            "train": list(train_files if train_files is not None else ["builtin:en_train"]),
            "val": list(val_files if val_files is not None else ["builtin:en_test"]),
            "test": list(test_files if test_files is not None else ["builtin:en_test"]),
        }
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.limit = limit
        self._splits: dict[str, list[Profile]] = {}

    def profiles(self, split: str) -> list[Profile]:
        """The profiles of one split ("train", "val" or "test"), loaded once."""
        if split not in self.files:
            raise ValueError(f"unknown split {split!r}; splits: train, val, test")
        if split not in self._splits:
            loaded = load_profile_sets(self.files[split])
            self._splits[split] = loaded[: self.limit] if self.limit else loaded
        return self._splits[split]

    def setup(self, stage: str | None = None) -> None:
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
        return self._loader("train", self.shuffle)

    def val_dataloader(self) -> DataLoader[Profile]:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader[Profile]:
        return self._loader("test", False)
