"""Profiles: loading, validation and the LightningDataModule.

May import `rlver.core` only.
"""

from rlver.data.profiles import ProfileError, load_profile_sets, load_profiles, resolve_profile_path

__all__ = ["ProfileError", "load_profile_sets", "load_profiles", "resolve_profile_path"]
