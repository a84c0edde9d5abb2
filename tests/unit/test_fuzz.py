"""Bad input never costs a traceback: property-based fuzzing of the loaders users feed files to.

Each loader gets at least 200 generated cases (hypothesis, derandomized so CI is
reproducible): valid files broken in the ways real files break (a field dropped or of the
wrong type, a line cut off or of random text, bytes that are not UTF-8, duplicate ids, YAML
with a stray character, unknown keys). Each case either loads, or fails with the loader's one
error type whose message names the file and line and the field, or the recipe's flag.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlver.data.profiles import ProfileError, load_profiles, resolve_profile_path
from rlver.evaluate.score import ScoreError, load_scored_file
from tests.conftest import REPO

# parse_recipe hands LightningCLI its args while pytest's own are in sys.argv: its warning, 200 times.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)


def encode(record) -> str:
    return json.dumps(record, ensure_ascii=False, allow_nan=True)


@st.composite
def broken_jsonl(draw, records: list[dict], nested_fields: dict[str, list[str]] | None = None) -> bytes:
    """A few valid records as JSONL bytes, with one to three of the ways real files break."""
    chosen = draw(st.lists(st.sampled_from(records), min_size=0, max_size=4))
    lines = [encode(r).encode() for r in chosen]
    for _ in range(draw(st.integers(1, 3))):
        how = draw(
            st.sampled_from(
                ["drop", "retype", "nested", "cut", "text", "bytes", "duplicate", "blank", "non-object"]
            )
        )
        index = draw(st.integers(0, max(len(lines) - 1, 0)))
        if not lines and how not in ("text", "bytes", "blank", "non-object"):
            continue
        if how in ("drop", "retype", "nested"):
            try:
                record = json.loads(lines[index])
            except ValueError:
                continue  # already broken by an earlier change
            if not isinstance(record, dict) or not record:
                continue
            if how == "drop":
                del record[draw(st.sampled_from(sorted(record)))]
            elif how == "retype":
                record[draw(st.sampled_from(sorted(record)))] = draw(json_values)
            elif nested_fields:
                field = draw(st.sampled_from(sorted(nested_fields)))
                items = record.get(field)
                if isinstance(items, list) and items:
                    item = items[draw(st.integers(0, len(items) - 1))]
                    if isinstance(item, dict):
                        item[draw(st.sampled_from(nested_fields[field]))] = draw(json_values)
            lines[index] = encode(record).encode()
        elif how == "cut":
            lines[index] = lines[index][: draw(st.integers(0, max(len(lines[index]) - 1, 0)))]
        elif how == "text":
            text = draw(st.text(min_size=1, max_size=30).filter(lambda t: not any(c in t for c in "\n\r")))
            lines.insert(index, text.encode())
        elif how == "bytes":
            lines.insert(index, draw(st.binary(min_size=1, max_size=20)).replace(b"\n", b" "))
        elif how == "duplicate":
            lines.insert(index, lines[index])
        elif how == "blank":
            lines.insert(index, b"   ")
        else:
            lines.insert(index, encode(draw(st.lists(json_values, max_size=2))).encode())
    return b"\n".join(lines) + (b"\n" if draw(st.booleans()) else b"")


def assert_names_file_and_line(error: Exception, path: Path) -> None:
    message = str(error)
    assert message.startswith(str(path)), message
    assert "\n" not in message and "Traceback" not in message, message
    rest = message[len(str(path)) :]
    assert re.match(r":\d+: ", rest) or rest in (": no profiles in file", ": no dialogues in file"), message


# --------------------------------------------------------------------------- profiles
PROFILES = [
    json.loads(line) for line in resolve_profile_path("builtin:en_train").read_text().splitlines()[:4]
]


@FUZZ
@given(data=broken_jsonl(PROFILES))
def test_profile_loader_on_broken_files(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("profiles") / "profiles.jsonl"
    path.write_bytes(data)
    try:
        profiles = load_profiles(path)
    except ProfileError as error:
        assert_names_file_and_line(error, path)
        message = str(error)
        assert any(
            word in message
            for word in ("field '", "invalid JSON", "expected a JSON object", "not UTF-8", "no profiles")
        ), message
    else:
        assert profiles and all(p.id and p.player for p in profiles)


# --------------------------------------------------------------------------- rlver score
SAGE_RECORDS = [
    {
        "id": f"d{i}",
        "emo_point": 40 + i,
        "emo_state": "Emotion-B",
        "history": [
            {"role": "user", "content": "hi", "emotion-point": 30},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "ok", "emotion-point": 40 + i},
        ],
    }
    for i in range(2)
] + [{"profile_id": "p", "emotions": [30.0, 45.0], "final_emotion": 45.0, "turns": []}]


@FUZZ
@given(data=broken_jsonl(SAGE_RECORDS, {"history": ["emotion-point", "role"], "turns": ["emotion"]}))
def test_score_loader_on_broken_files(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("scores") / "model.jsonl"
    path.write_bytes(data)
    try:
        scored = load_scored_file(path)
    except ScoreError as error:
        assert_names_file_and_line(error, path)
    else:
        summary = scored.summary()
        assert summary["dialogues"] >= 1
        assert all(math.isfinite(e) for d in scored.dialogues for e in d.emotions)
        assert math.isfinite(summary["score"])


# --------------------------------------------------------------------------- recipes
RECIPES = ["quickstart", "grpo_nothink"]


def leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, (*prefix, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from leaves(value, (*prefix, index))
    else:
        yield prefix


@st.composite
def broken_recipe(draw):
    name = draw(st.sampled_from(RECIPES))
    text = (REPO / "recipes" / f"{name}.yaml").read_text()
    how = draw(st.sampled_from(["retype", "drop", "unknown", "syntax"]))
    if how == "syntax":
        position = draw(st.integers(0, len(text)))
        junk = draw(st.sampled_from(["[", "{", ": :", "\t", "'", '"', "- ", "&a", "*b", "!!python/object "]))
        return how, None, text[:position] + junk + text[position:]
    tree = yaml.safe_load(text)
    paths = [p for p in leaves(tree) if p and p[0] in ("trainer", "model", "data")]
    path = draw(st.sampled_from(paths))
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    if how == "retype":
        parent[path[-1]] = draw(json_values.filter(lambda v: not isinstance(v, float) or math.isfinite(v)))
    elif how == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent["no_such_option"] = 1
        path = (*path[:-1], "no_such_option")
    return how, path, yaml.safe_dump(tree, allow_unicode=True, sort_keys=False)


@FUZZ
@given(case=broken_recipe())
def test_recipe_parsing_on_broken_recipes(tmp_path_factory, case):
    from rlver.cli import check_config_files, parse_recipe

    how, key_path, text = case
    path = tmp_path_factory.mktemp("recipes") / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        check_config_files(["--config", str(path)])
        parse_recipe(str(path))
    except Exception as error:
        message = str(error)
        assert "Traceback" not in message, message
        if "invalid YAML" in message:
            assert re.search(rf"{re.escape(str(path))}:\d+:\d+: invalid YAML: ", message), message
        elif how == "syntax":  # still YAML, now with a misspelt or misplaced option: named
            assert re.search(r"option|key|parser|expected|not a name", message, re.IGNORECASE), message
        else:
            # jsonargparse names the dotted flag ("model.rollout.max_turns") or the option.
            named = [k for k in key_path if isinstance(k, str) and k not in ("trainer", "model", "data")]
            assert any(k in message for k in named), (key_path, message)


def test_a_recipe_with_a_yaml_error_fails_naming_file_and_line(tmp_path):
    from rlver.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  rollout:\n    max_turns: 2\n   bad: [\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:4:\d+: invalid YAML: "):
        from rlver.cli import check_config_files

        check_config_files(["fit", "--config", str(path)])
    assert main(["fit", "--config", str(path)]) == 2
