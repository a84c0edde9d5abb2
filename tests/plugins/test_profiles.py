import dataclasses
import json
import re
from collections import Counter

import pytest

from rlver.core.types import HiddenTheme, Personality, theme_from_text
from rlver.data.datamodule import ProfileDataModule
from rlver.data.profiles import ProfileError, load_profile_sets, load_profiles, parse_profile
from tests.conftest import OFFICIAL_SAMPLE

GOOD = {
    "id": "x1",
    "player": "* Name: Ana",
    "scene": "A story.",
    "main_cha": "passive",
    "cha_group": ["quiet", "kind", "tired"],
    "task": "You want deep empathy for what you feel, not shallow comfort.",
}


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.mark.skipif(not OFFICIAL_SAMPLE.exists(), reason="../shared data not present")
def test_official_chinese_sample_loads_unchanged():
    profiles = load_profiles(OFFICIAL_SAMPLE)
    assert len(profiles) == 12
    raw = [
        json.loads(line) for line in OFFICIAL_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    for profile, record in zip(profiles, raw):
        assert profile.to_record() == record
        assert profile.theme is not None, record["task"]
        assert profile.personality is not None
        assert profile.language == "zh"


@pytest.mark.parametrize(("name", "count"), [("builtin:en_train", 48), ("builtin:en_test", 64)])
def test_english_sets_cover_every_theme_and_personality(name, count):
    profiles = load_profiles(name)
    assert len(profiles) == count
    themes = Counter(p.theme for p in profiles)
    assert set(themes) == set(HiddenTheme)
    assert len(set(themes.values())) == 1  # balanced
    assert {p.personality for p in profiles} == set(Personality)
    for profile in profiles:
        assert profile.language == "en"
        assert profile.first_talk and len(profile.first_talk) > 10
        assert theme_from_text(profile.task) is profile.theme  # the task text says the same theme
        sim = profile.extra["sim"]
        assert len(sim["facts"]) >= 6
        assert set(sim["reactions"]) == {"high", "medium", "low"}
        assert set(sim["goodbye"]) == {"success", "failure"}
        assert "Hidden theme" in profile.scene


def test_train_set_has_every_theme_personality_pair_twice():
    pairs = Counter((p.theme, p.personality) for p in load_profiles("builtin:en_train"))
    assert len(pairs) == 24 and set(pairs.values()) == {2}


def test_train_and_test_ids_are_disjoint():
    assert len(load_profile_sets(["builtin:en_train", "builtin:en_test"])) == 112


def _persona_name(profile):
    return profile.player.splitlines()[0].split(":", 1)[1].strip()


def _persona_runs(profile, words=8):
    """Every run of `words` words in what makes the person: persona sheet from the hobbies on (the
    name/age/gender lines share their shape), background story, opening line and facts."""
    sheet = profile.player.split("* Hobbies", 1)[-1]
    story = profile.scene.split("## Emotion and reactions", 1)[0]
    text = " ".join([sheet, story, profile.first_talk or "", *profile.extra["sim"]["facts"]])
    tokens = re.findall(r"[a-z0-9']+", text.lower())
    return {" ".join(tokens[i : i + words]) for i in range(len(tokens) - words + 1)}


def test_test_users_share_no_persona_text_with_training_users():
    train, test = load_profiles("builtin:en_train"), load_profiles("builtin:en_test")
    assert not {_persona_name(p) for p in train} & {_persona_name(p) for p in test}
    assert len({_persona_name(p) for p in test}) == len(test)  # every test user is a different person
    seen = set().union(*(_persona_runs(p) for p in train))
    for profile in test:
        shared = _persona_runs(profile) & seen
        assert not shared, f"{profile.id} shares persona text with a training user: {sorted(shared)[:3]}"
    # The check itself catches a copied story line.
    copied = dataclasses.replace(test[0], first_talk=train[0].extra["sim"]["facts"][0])
    assert _persona_runs(copied) & seen


def test_test_set_has_every_theme_personality_pair_and_eight_users_a_theme():
    profiles = load_profiles("builtin:en_test")
    assert set(Counter(p.theme for p in profiles).values()) == {8}
    pairs = Counter((p.theme, p.personality) for p in profiles)
    assert len(pairs) == 24  # 3 personality types for every theme


def test_extra_fields_are_kept(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{**GOOD, "topic": "work", "first_talk": "hi there"}])
    (profile,) = load_profiles(path)
    assert profile.extra == {"topic": "work"}
    assert profile.first_talk == "hi there"
    assert profile.theme is HiddenTheme.DEEP_EMPATHY


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "x2", ', r"p\.jsonl:2: invalid JSON"),
        ('["a list"]', r"p\.jsonl:2: expected a JSON object, got list"),
        (
            {k: v for k, v in GOOD.items() if k != "scene"} | {"id": "x2"},
            r"p\.jsonl:2: field 'scene': missing",
        ),
        (GOOD | {"id": "x2", "task": 7}, r"p\.jsonl:2: field 'task': expected a string, got int"),
        (GOOD | {"id": "x2", "player": "  "}, r"p\.jsonl:2: field 'player': empty"),
        (
            GOOD | {"id": "x2", "cha_group": "shy"},
            r"p\.jsonl:2: field 'cha_group': expected a list of strings",
        ),
        (
            GOOD | {"id": "x2", "main_cha": "grumpy"},
            r"p\.jsonl:2: field 'main_cha': unknown personality type",
        ),
        (GOOD | {"id": "x2", "first_talk": 3}, r"p\.jsonl:2: field 'first_talk': expected a string"),
        (GOOD | {"id": "x2", "theme": "telepathy"}, r"p\.jsonl:2: field 'theme': unknown hidden theme"),
        (GOOD, r"p\.jsonl:2: field 'id': duplicate id 'x1' \(first at line 1\)"),
    ],
)
def test_each_bad_line_names_file_line_and_field(tmp_path, line, message):
    path = write_lines(tmp_path / "p.jsonl", [GOOD, line])
    with pytest.raises(ProfileError, match=message):
        load_profiles(path)


def test_duplicate_across_files_names_both_places(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", [GOOD])
    second = write_lines(tmp_path / "b.jsonl", [GOOD | {"id": "y"}, GOOD])
    with pytest.raises(
        ProfileError, match=r"b\.jsonl:2: field 'id': duplicate id 'x1' \(first at .*a\.jsonl:1\)"
    ):
        load_profile_sets([first, second])


def test_missing_file_and_unknown_builtin(tmp_path):
    with pytest.raises(ProfileError, match="profile file not found"):
        load_profiles(tmp_path / "nope.jsonl")
    with pytest.raises(
        ProfileError, match="unknown built-in profile set 'builtin:fr'; available: en_test, en_train"
    ):
        load_profiles("builtin:fr")


def test_parse_profile_reports_where():
    with pytest.raises(ProfileError, match="here:3: field 'id': missing"):
        parse_profile({}, where="here:3")


def test_datamodule_serves_splits_as_profile_lists():
    data = ProfileDataModule(batch_size=5, limit=7)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert len(batch) == 5 and all(p.id.startswith("en-train") for p in batch)
    assert [len(b) for b in data.val_dataloader()] == [5, 2]
    assert next(iter(data.test_dataloader()))[0].id.startswith("en-test")


def test_train_limit_makes_every_pass_show_the_same_users():
    data = ProfileDataModule(batch_size=2, train_limit=6, seed=3)
    data.setup("fit")
    passes = [
        [p.id for b in [data.train_batch_at(step) for step in range(k * 3, k * 3 + 3)] for p in b]
        for k in range(4)
    ]
    assert all(sorted(one) == sorted(passes[0]) for one in passes) and len(set(passes[0])) == 6
    assert len({tuple(one) for one in passes}) > 1  # shuffled anew each pass
    assert len(data.profiles("test")) == len(ProfileDataModule().profiles("test"))  # only training is limited
    with pytest.raises(ValueError, match=r"--data.train_limit \(-1\) must be >= 0"):
        ProfileDataModule(train_limit=-1)


def test_datamodule_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"--data.batch_size \(0\) must be >= 1"):
        ProfileDataModule(batch_size=0)
