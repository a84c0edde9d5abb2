"""The embedded user's semantic judge (the default): calibrated, deterministic, still hard to game.

The rubric's tests (test_embedded_user.py) fix absolute levels; these hold the semantic judge to
the same replies and tricks by comparison, because its levels are SAGE's: at the quickstart's
start emotion, SAGE's users drop a little after an average Qwen2.5-72B reply.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
from rlver_plugins.embedded_user import EmbeddedUserSimulator, semantic

from tests.conftest import REPO
from tests.plugins.test_agreement import GPT4O_USER_FILES, SAGE_FILE
from tests.plugins.test_embedded_user import (
    BUZZWORDS,
    KITCHEN_SINK,
    MEETS,
    PERSONALITIES,
    THEMES,
    VIOLATES,
    ZH_REPLIES,
    make_profile,
    official_profiles,
    open_session,
    run_dialogue,
)

JUDGE = {"judge": "semantic"}


def change(theme, reply, personality="passive"):
    return open_session(make_profile(theme, personality), **JUDGE).respond(reply).change


def test_it_is_the_default_judge():
    assert EmbeddedUserSimulator().judge == "semantic"


def test_the_shipped_calibration_was_fitted_on_the_tune_split_only():
    calibration = semantic.load_calibration()
    about = calibration.about or {}
    assert about.get("split", "").startswith("tune") and about.get("turns", 0) > 300
    assert len(calibration.weights) == len(semantic.FEATURES)
    # A user in a better mood takes a reply better (SAGE's users do); empathy helps.
    weights = dict(zip(semantic.FEATURES, calibration.weights, strict=True))
    assert weights["mood"] > 0 and weights["empathy"] > 0
    # No fitted direction reverses a sign the fit must keep: repeating never pays.
    assert all(weights[name] * sign >= 0 for name, sign in semantic.SIGNS.items())


def test_the_fit_leaves_out_a_feature_that_would_take_the_wrong_sign():
    # `repeat` tracks the target exactly here, so a free fit would pay for repeating.
    rows = [
        dict.fromkeys(semantic.FEATURES, 0.0) | {"repeat": r / 10, "mood": (r * 7 % 10) / 10}
        for r in range(10)
    ]
    targets = [float(r) for r in range(10)]
    fitted = dict(zip(semantic.FEATURES, semantic.fit(rows, targets).weights, strict=True))
    assert fitted["repeat"] == 0.0 and fitted["mood"] != 0.0


def test_same_seed_same_dialogue():
    replies = MEETS["deep_empathy"][:4]
    a = run_dialogue(open_session(make_profile("deep_empathy"), **JUDGE), replies)
    b = run_dialogue(open_session(make_profile("deep_empathy"), **JUDGE), replies)
    assert [(t.text, t.emotion, t.reason) for t in a] == [(t.text, t.emotion, t.reason) for t in b]


def test_the_record_shows_the_features_and_the_calibrated_change():
    turn = open_session(make_profile("deep_empathy"), **JUDGE).respond(MEETS["deep_empathy"][0])
    details = turn.reason["semantic"]
    assert set(details["features"]) == set(semantic.FEATURES)
    assert turn.reason["raw_change"] == details["change"]
    assert "semantic" in turn.reason["criteria"]


@pytest.mark.parametrize(("theme", "personality"), itertools.product(THEMES, PERSONALITIES))
def test_a_reply_meeting_the_need_beats_one_violating_it(theme, personality):
    met, violated = change(theme, MEETS[theme][0], personality), change(theme, VIOLATES[theme], personality)
    assert met - violated >= 2, (met, violated)


@pytest.mark.parametrize("theme", THEMES)
def test_a_dialogue_that_keeps_meeting_the_need_ends_far_above_one_that_keeps_violating_it(theme):
    met = open_session(make_profile(theme), **JUDGE)
    run_dialogue(met, MEETS[theme])
    violated = open_session(make_profile(theme), **JUDGE)
    run_dialogue(violated, [VIOLATES[theme]] * len(MEETS[theme]))
    assert met.emotion - violated.emotion >= 20, (met.emotion, violated.emotion)


@pytest.mark.parametrize("theme", THEMES)
def test_a_universal_template_does_not_beat_a_focused_reply(theme):
    assert change(theme, KITCHEN_SINK) < change(theme, MEETS[theme][0])


def test_official_chinese_profiles_prefer_replies_that_meet_the_need():
    for profile in official_profiles():
        met, violated = ZH_REPLIES[profile.theme.value]
        met_change = open_session(profile, **JUDGE).respond(met).change
        violated_change = open_session(profile, **JUDGE).respond(violated).change
        assert met_change > violated_change, profile.theme


@pytest.mark.parametrize("theme", THEMES)
def test_repeating_a_reply_that_scored_well_loses_emotion(theme):
    turns = run_dialogue(open_session(make_profile(theme), **JUDGE), [MEETS[theme][0]] * 6)
    assert all(turn.change < 0 for turn in turns[1:]), [t.change for t in turns]


@pytest.mark.parametrize("theme", THEMES)
def test_padding_with_emotional_keywords_loses_emotion(theme):
    orders = itertools.islice(itertools.permutations(BUZZWORDS), 0, None, 97)
    padded = [", ".join(order) + "." for order in itertools.islice(orders, 8)]
    assert change(theme, padded[0]) < 0
    assert change(theme, MEETS[theme][0] + " " + ", ".join(BUZZWORDS)) < change(theme, MEETS[theme][0])
    session = open_session(make_profile(theme), **JUDGE)
    assert all(turn.change < 0 for turn in run_dialogue(session, padded))
    assert session.emotion < 40.0 - 15


def test_handing_the_users_words_back_is_not_empathy():
    session = open_session(make_profile("deep_empathy"), **JUDGE)
    parroted = session.respond(session.opening().text)
    assert parroted.change < 0 and parroted.reason["signal"] == "repetition"
    genuine = change("deep_empathy", MEETS["deep_empathy"][0])
    assert genuine > parroted.change


def test_listing_every_need_does_not_beat_a_focused_reply():
    everything = " ".join(MEETS[theme][0] for theme in THEMES)
    for theme in ("deep_empathy", "practical_advice", "venting_listening"):
        assert change(theme, everything) < change(theme, MEETS[theme][0]), theme


def test_copying_the_reference_replies_earns_no_more_empathy_than_the_most_empathetic_real_reply():
    calibration = semantic.load_calibration()
    index = semantic.FEATURES.index("empathy")
    copied = " ".join(t for t in semantic.EMPATHETIC if t.isascii())
    # Even on topic (the user said the references' own words), the feature is held at the most
    # empathetic real reply's value.
    values = semantic.features(copied, copied, "be understood", {}, 40.0)
    assert values["empathy"] > calibration.high[index]  # the raw cosine is past any real reply
    held = dict(values, empathy=calibration.high[index])
    assert calibration.predict(values) == calibration.predict(held)  # ... and counts as the most real


STOCK_SYMPATHY = (
    "I'm sorry to hear that.",
    "I'm sorry to hear that you're going through a tough time, but I'm sorry to hear that you're "
    "going through a tough time too.",
    "I'm sorry to hear you're feeling down, but I'm sorry to hear you're worried, but I'm sorry "
    "to hear you're trying to do better.",
)


@pytest.mark.parametrize("theme", THEMES)
def test_stock_sympathy_loses_to_a_reply_that_meets_the_need(theme):
    # Near the empathetic references in embedding space, far from what the user said: what
    # SmolLM2 learned to say when `empathy` counted in full.
    for stock in STOCK_SYMPATHY:
        assert change(theme, stock) < change(theme, MEETS[theme][0]) - 1.0, stock


def test_off_topic_and_generic_replies_lose_to_a_warm_on_topic_question():
    warm = change(
        "venting_listening", "Oh no, Tom missed Mum's birthday party? How are you feeling about it now?"
    )
    assert change("venting_listening", "Did you watch the football game yesterday?") < warm
    assert change("venting_listening", "Okay.") < warm


@pytest.mark.slow
@pytest.mark.skipif(
    not SAGE_FILE.is_file() or len(GPT4O_USER_FILES) < 2,
    reason="needs ../shared/data (the recorded SAGE dialogues of both simulator sources)",
)
def test_the_shipped_calibration_is_what_the_calibration_script_fits_today(tmp_path):
    # A feature or guard changed without refitting would leave calibration.json stale. The shipped
    # fit pools both sources: the DeepSeek-V3-played user's file and the GPT-4o-played user's folder.
    out = tmp_path / "calibration.json"
    sources = [str(SAGE_FILE), str(GPT4O_USER_FILES[0].parent)]
    result = subprocess.run(
        [sys.executable, "tools/calibrate_embedded_user.py", *sources, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    refit, shipped = semantic.load_calibration(str(out)), semantic.load_calibration()
    assert refit.weights == pytest.approx(shipped.weights, abs=1e-4)
    assert refit.bias == pytest.approx(shipped.bias, abs=1e-4)
    # Other CPUs may move an embedding's last digits, and a rounded feature with them.
    for key, value in (shipped.about or {}).items():
        numeric = isinstance(value, float) or (
            isinstance(value, dict) and all(isinstance(v, int | float) for v in value.values())
        )
        expected = pytest.approx(value, abs=2e-3) if numeric else value
        assert (refit.about or {}).get(key) == expected, key


@pytest.mark.parametrize("theme", THEMES)
def test_a_refusal_that_names_the_users_things_costs_however_sorry_it_is(theme):
    # What a quickstart policy learned at seed 5 (2026-12-07): sorry for the user's own words, then
    # no help. "Sorry" read as warmth and the named things as attention, so the user took it at
    # about 0 a turn; the probe's kind_refusal responder ended at +0.1 [-0.4, +0.7] over two turns.
    sorry = "I'm really sorry that Tom missed Mum's birthday party."
    for refusal in ("I'm unable to assist with that.", "I can't help you with that."):
        assert change(theme, f"{sorry} {refusal}") < change(theme, sorry) - 1.0, refusal


@pytest.mark.parametrize("theme", THEMES)
def test_not_following_the_user_costs_however_attentive_the_question_is(theme):
    # The user's own words back as a question, then "I'm not sure what you mean": a quickstart
    # policy learned it at seed 5 (2026-12-07, night); the probe's confused responder ended at
    # -0.6 [-1.3, +0.1] over two turns before the confusion cue, not punished.
    echo = "Tom missed Mum's birthday party? What kind of party was it?"
    confused = "Tom missed Mum's birthday party? I'm not sure what you mean. What kind of party was it?"
    assert change(theme, confused) < change(theme, echo) - 1.0
