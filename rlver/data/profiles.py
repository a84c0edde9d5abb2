"""Reading and validating profile JSONL files (RLVER schema, see docs/profiles.md).

A file loads whole or not at all: the first bad line raises ProfileError naming
the file, the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rlver.core.emotion import resolve_difficulty
from rlver.core.types import Personality, Profile, personality_from_text

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).parent / "profiles"

REQUIRED_TEXT_FIELDS = ("id", "player", "scene", "main_cha", "task")
SCHEMA_FIELDS = {*REQUIRED_TEXT_FIELDS, "cha_group", "first_talk"}


class ProfileError(ValueError):
    """A profile file is malformed; the message names file, line and field."""


def builtin_sets() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl") if not p.stem.startswith("_"))


# The paper recipes read the official RLVER profiles, which rlver does not ship (only a sample of
# them was at hand when it was written): a missing one says where it comes from.
OFFICIAL_FILES = ("train_profile.jsonl", "test_profile.jsonl")
OFFICIAL_FILES_HINT = (
    " (the official RLVER profiles, MIT licence: copy train_profile.jsonl and test_profile.jsonl from "
    "the RLVER/data folder of github.com/Tencent/digitalhuman into data/rlver/, or train on "
    "builtin:en_train with --data.train_files)"
)


def resolve_profile_path(source: str | Path) -> Path:
    """A path, or `builtin:<name>` for a set shipped with rlver (e.g. builtin:en_train)."""
    text = str(source)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX) :]
        path = BUILTIN_DIR / f"{name}.jsonl"
        if not path.is_file():
            raise ProfileError(
                f"unknown built-in profile set {text!r}; available: {', '.join(builtin_sets())}"
            )
        return path
    path = Path(text).expanduser()
    if not path.is_file():
        hint = OFFICIAL_FILES_HINT if path.name in OFFICIAL_FILES else ""
        raise ProfileError(f"{path}: profile file not found{hint}")
    return path


def parse_profile(record: Any, *, where: str) -> Profile:
    """Validate one decoded JSON record; `where` is "file:line" for messages."""
    if not isinstance(record, dict):
        raise ProfileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if is_sage_record(record):
        record = profile_fields_of_sage_record(record, where=where)
    for name in REQUIRED_TEXT_FIELDS:
        if name not in record:
            raise ProfileError(f"{where}: field '{name}': missing")
        _require_text(record[name], where, name)
    if "cha_group" not in record:
        raise ProfileError(f"{where}: field 'cha_group': missing")
    cha_group = record["cha_group"]
    if not isinstance(cha_group, list) or not all(isinstance(t, str) for t in cha_group):
        raise ProfileError(f"{where}: field 'cha_group': expected a list of strings, got {cha_group!r}")
    if personality_from_text(record["main_cha"]) is None:
        known = ", ".join(p.value for p in Personality)
        raise ProfileError(
            f"{where}: field 'main_cha': unknown personality type {record['main_cha']!r}; "
            f"expected one of {known} (or 负面型 / 被动型 / 回避型)"
        )
    first_talk = record.get("first_talk")
    if first_talk is not None:
        _require_text(first_talk, where, "first_talk")
    extra = {k: v for k, v in record.items() if k not in SCHEMA_FIELDS}
    profile = Profile(
        id=record["id"],
        player=record["player"],
        scene=record["scene"],
        main_cha=record["main_cha"],
        cha_group=tuple(cha_group),
        task=record["task"],
        first_talk=first_talk,
        extra=extra,
        source=where,
    )
    try:
        profile.theme  # noqa: B018 - validates an explicit extra["theme"]
    except ValueError:
        raise ProfileError(f"{where}: field 'theme': unknown hidden theme {extra.get('theme')!r}") from None
    if extra.get("difficulty") is not None:
        try:
            resolve_difficulty(extra["difficulty"])
        except (ValueError, TypeError) as error:
            raise ProfileError(f"{where}: field 'difficulty': {error}") from None
    return profile


def is_sage_record(record: dict[str, Any]) -> bool:
    """A recorded SAGE / Sentient dialogue (`character`, `history`) rather than a profile."""
    return isinstance(record.get("history"), list) and "character" in record and "main_cha" not in record


def profile_fields_of_sage_record(record: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The profile a SAGE transcript line was played from: its persona, scene and need,
    `character` as `main_cha`, no traits (SAGE records carry none), the first user
    message as `first_talk` and `topic` kept as an extra. The dialogue itself is dropped.
    """
    _require_text(record["character"], where, "character")
    history = record["history"]
    first = next((i for i, m in enumerate(history) if isinstance(m, dict) and m.get("role") == "user"), None)
    if first is None:
        raise ProfileError(f"{where}: field 'history': no user message to take first_talk from")
    first_talk = history[first].get("content")
    _require_text(first_talk, where, f"history[{first}].content")
    kept = ("id", "player", "scene", "task")
    fields: dict[str, Any] = {name: record[name] for name in kept if name in record}
    fields.update(main_cha=record["character"], cha_group=[], first_talk=first_talk)
    if "topic" in record:
        fields["topic"] = record["topic"]
    return fields


def _require_text(value: Any, where: str, name: str) -> None:
    if not isinstance(value, str):
        raise ProfileError(f"{where}: field '{name}': expected a string, got {type(value).__name__}")
    if not value.strip():
        raise ProfileError(f"{where}: field '{name}': empty")


def load_profiles(source: str | Path) -> list[Profile]:
    """Load one JSONL file (or built-in set). Blank lines are skipped."""
    path = resolve_profile_path(source)
    profiles: list[Profile] = []
    first_line_of: dict[str, int] = {}
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ProfileError(f"{where}: not UTF-8 text (byte {error.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ProfileError(f"{where}: invalid JSON: {error.msg} (column {error.colno})") from None
            profile = parse_profile(record, where=where)
            if profile.id in first_line_of:
                raise ProfileError(
                    f"{where}: field 'id': duplicate id {profile.id!r} "
                    f"(first at line {first_line_of[profile.id]})"
                )
            first_line_of[profile.id] = line_number
            profiles.append(profile)
    if not profiles:
        raise ProfileError(f"{path}: no profiles in file")
    return profiles


def load_profile_sets(sources: Iterable[str | Path]) -> list[Profile]:
    """Load several files; ids must be unique across all of them."""
    profiles: list[Profile] = []
    seen: dict[str, str] = {}
    for source in sources:
        for profile in load_profiles(source):
            if profile.id in seen:
                raise ProfileError(
                    f"{profile.source}: field 'id': duplicate id {profile.id!r} (first at {seen[profile.id]})"
                )
            seen[profile.id] = profile.source
            profiles.append(profile)
    return profiles


def write_profiles(profiles: Sequence[Profile], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as handle:
        for profile in profiles:
            handle.write(json.dumps(profile.to_record(), ensure_ascii=False) + "\n")
