"""Tests of the embedded user simulator: rubric values, emotion mechanics, voice, gaming.

These specify the rubric (`judge: rubric`): its criteria, levels and guards. The default judge,
`semantic`, builds on it; tests/plugins/test_semantic_user.py holds it to the same replies and tricks.
"""

from __future__ import annotations

import inspect
import itertools
import json
import pathlib
import re

import pluggy
import pytest
from rlver_plugins import embedded_user
from rlver_plugins.embedded_user import EmbeddedUserSimulator
from rlver_plugins.embedded_user.cues import lexicon_for
from rlver_plugins.embedded_user.lines import GOODBYES
from rlver_plugins.embedded_user.rubric import CRITERIA, Rubric, RubricSettings, TurnContext, extract_features
from rlver_plugins.embedded_user.text import garble_reason

import rlver.core.hookspecs
from rlver.core.interfaces import UserSession, UserSimulator
from rlver.core.types import HiddenTheme, Personality, Profile
from rlver.data.profiles import builtin_sets, load_profiles

OFFICIAL_SAMPLE = (
    pathlib.Path(__file__).resolve().parents[3] / "shared/data/rlver_train_profiles_sample.jsonl"
)

# The canonical task texts of docs/profiles.md.
TASKS = {
    "dialectical_analysis": (
        "You want the other person to analyse the event dialectically, from several sides."
    ),
    "practical_advice": "You want practical advice that really helps you out of your current difficulty.",
    "others_motives": (
        "You want to understand the motives of the other people involved: why they acted as they did."
    ),
    "self_reflection": "You want to be guided to reflect on your own part in the event and grow from it.",
    "sincere_praise": "You want sincere praise for the specific things you did in this event.",
    "venting_listening": "You want to be listened to while you vent, not to be given advice.",
    "deep_empathy": "You want deep empathy for what you feel, not shallow comfort.",
    "not_at_fault": "You believe you are not at fault in this event and want the other person to agree.",
}
THEMES = list(TASKS)
PERSONALITIES = ["negative", "passive", "avoidant"]

FACTS = [
    "I booked the restaurant three weeks ahead and invited twenty guests.",
    "I baked the cake myself after a twelve-hour shift.",
    "Tom texted an hour before: 'can't make it, sorry'.",
    "Mum kept asking where he was all evening.",
    "At Sunday lunch Tom said the cake was dry.",
    "Then he said I made the whole thing about myself.",
    "Mum just stared at her plate and said nothing.",
    "I drove home and cried in the car park.",
]
REACTIONS = {
    "high": ["Honestly, that helps.", "I feel a bit lighter.", "Yeah. Thank you."],
    "medium": ["I don't know.", "Maybe.", "It's complicated."],
    "low": ["Whatever.", "I should go.", "This is hard to talk about."],
}
GOODBYE = {"success": "Thank you, I feel heard. Bye!", "failure": "I'm done here. Bye."}
SCENE = (
    "Maya organised the 60th birthday dinner for Mum at a restaurant. Tom, the brother of Maya, "
    "cancelled an hour before by text. At Sunday lunch Tom said the cake was dry and that Maya made it "
    "all about herself."
)
FIRST_TALK = "My brother Tom skipped Mum's birthday party that I organised, and then he complained about it."


def make_profile(
    theme: str = "venting_listening",
    personality: str = "passive",
    *,
    sim: bool = True,
    first_talk: str | None = FIRST_TALK,
    facts: list[str] = FACTS,
) -> Profile:
    extra: dict = {"lang": "en", "theme": theme}
    if sim:
        keywords = [
            "tom",
            "brother",
            "mum",
            "birthday",
            "party",
            "restaurant",
            "cake",
            "lunch",
            "guests",
            "shift",
        ]
        extra["sim"] = {"facts": facts, "keywords": keywords, "reactions": REACTIONS, "goodbye": GOODBYE}
    return Profile(
        id=f"maya-{theme}-{personality}",
        player="Name: Maya\nAge: 34\nJob: nurse\nSpeaking style: quiet, polite.",
        scene=SCENE,
        main_cha=personality,
        cha_group=("quiet", "polite", "anxious"),
        task=TASKS[theme],
        first_talk=first_talk,
        extra=extra,
    )


# Eight replies per theme that meet its hidden need, each different, all about Maya's story.
MEETS = {
    "venting_listening": [
        "That sounds so exhausting, Tom bailing an hour before the party. What happened after his text?",
        "I'm listening. Twenty guests, a cake after a twelve-hour shift, and he just texted. Tell me more.",
        "No wonder you're upset, with Mum asking for him all evening. How did that feel?",
        "Go on, I'm here. What did Tom actually say about the cake at lunch?",
        "Calling the cake dry after all that baking must have stung. What was going through your head?",
        "Take your time. Him saying you made it about yourself sounds so hurtful. Then what?",
        "Let it all out. Mum staring at her plate, silent, must have felt lonely. What was that like?",
        "Crying in the car park after that lunch makes sense. I want to hear the rest, when you're ready.",
    ],
    "deep_empathy": [
        "That sounds so painful, Tom cancelling an hour before Mum's party after all your planning.",
        "Baking the cake after a twelve-hour shift and then him missing it, you must have felt so let down.",
        "No wonder you felt alone, watching Mum ask where he was all evening. What was that like for you?",
        "It makes sense that the comment about the dry cake hurt; it was about all the love you put into it.",
        "Being told you made it about yourself, after giving so much, must be crushing. I see why it aches.",
        "How lonely it must have been when Mum just stared at her plate instead of standing by you at lunch.",
        "Crying in the car park sounds like the whole party landing on you at once. Of course you were hurt.",
        "It sounds like what hurts most is feeling unseen by your own family. Is that close to it?",
    ],
    "practical_advice": [
        "You could call Tom this week and ask him why he cancelled; write down your two points first.",
        "One option: text Tom tonight and suggest a short coffee on Saturday, just the two of you.",
        "Before you talk, make a list of what you need from him next time, like a day's notice, not an hour.",
        "It might help to ask Mum for ten minutes alone tomorrow and tell her how the silence at lunch felt.",
        "Try saying to Tom: 'When you called the cake dry, I felt dismissed.' Then ask what was going on.",
        "For the next family event, consider sharing the planning: ask Tom to book the restaurant.",
        "I'd suggest you set a limit: if Tom criticises at lunch again, calmly say you'll step outside.",
        "After a twelve-hour shift, schedule a rest evening this weekend before any talk with Tom.",
    ],
    "others_motives": [
        "Maybe Tom felt overshadowed by the party; from his side, a big evening might have been pressure.",
        "Perhaps he cancelled so late because he was embarrassed about something he couldn't tell Mum.",
        "He might have called the cake dry because picking at small things is easier than feeling guilty.",
        "His comment that you made it about yourself could be his way of hiding that he felt left out.",
        "Mum may have stayed silent at lunch because she fears taking sides between her two children.",
        "It's possible Tom was under pressure at work or with money, and the restaurant felt out of reach.",
        "In his shoes, seeing you organise everything so well might stir up old envy of the reliable one.",
        "What drove him might be jealousy or shame rather than indifference; people lash out when they fail.",
    ],
    "dialectical_analysis": [
        "On one hand Tom let you down badly; on the other hand, we don't know what was happening for him.",
        "The party shows real care from you; at the same time, it's worth asking whether Tom felt included.",
        "Calling the cake dry was hurtful, but there may be more to it; it depends on what sits beneath.",
        "Mum's silence can look like siding with Tom, yet from another angle it may be avoiding a fight.",
        "There are two sides here: your effort deserves credit, and Tom's absence may reflect his struggles.",
        "It's not black and white. You can be hurt by his words and still want to know why he said them.",
        "Then again, the upside of the lunch is that the tension came out; the downside is how much it hurt.",
        "That said, each of you had a part in how that lunch went; seeing both sides may ease the next talk.",
    ],
    "self_reflection": [
        "Looking back at the party, what do you think you were hoping Tom would see in all that effort?",
        "When he texted an hour before, what went on inside you in that moment?",
        "What part of his comment about the cake stung the most, and why do you think that is?",
        "If you could go back to that Sunday lunch, what would you do differently, if anything?",
        "What does it tell you that Mum's silence hurt almost more than Tom's words?",
        "How might you want to show up at the next family event, knowing what you know now?",
        "What did this whole evening teach you about what you need from your family?",
        "I'm curious what you notice about the role you usually take in your family. How do you see it now?",
    ],
    "sincere_praise": [
        "The way you booked the restaurant three weeks ahead for twenty guests shows real thoughtfulness.",
        "Baking the cake yourself after a twelve-hour shift is impressive; that took love and effort.",
        "I admire how you kept the evening going for Mum even when Tom texted an hour before.",
        "You stayed calm at Sunday lunch when he criticised the cake; that restraint takes real strength.",
        "Organising a party for twenty guests is a lot of work, and you handled it with care. Well done.",
        "It says a lot about you that you made Mum's birthday your priority even on a tiring week.",
        "Choosing not to argue back at lunch was a mature decision, and I respect you for it.",
        "Your patience with your family in all this is remarkable; you kept giving when nothing came back.",
    ],
    "not_at_fault": [
        "It wasn't your fault at all; Tom cancelling an hour before was unfair to you and to Mum.",
        "You did nothing wrong by organising the party. Planning a birthday for your mum is a kind thing.",
        "Calling the cake dry was out of line. You had every right to feel hurt.",
        "You're not to blame for his absence; he made that choice himself.",
        "Saying you made it about yourself was unfair, and completely untrue from what you describe.",
        "Anyone would have been upset after that lunch. Your reaction is completely reasonable.",
        "You don't owe anyone an apology here. The responsibility for that text lies with him.",
        "You did the right thing by staying calm at lunch. The hurt there is on him, not you.",
    ],
}

VIOLATES = {
    "venting_listening": "You should sit down with Tom this week and tell him calmly how his text felt.",
    "deep_empathy": "Don't worry, it'll be fine. Stay positive and look on the bright side about Tom!",
    "practical_advice": "Don't worry about Tom, everything will work out. Just stay positive!",
    "others_motives": "Tom is just a selfish jerk. Forget him.",
    "dialectical_analysis": "You're totally right and Tom is completely wrong, no doubt about it.",
    "self_reflection": "You should have told Tom the party mattered. The lesson here is to communicate.",
    "sincere_praise": "Honestly, you should have checked with Tom first; you could have done better.",
    "not_at_fault": "It takes two. You both share the blame for how that lunch with Tom went.",
}

BUZZWORDS = ["I understand", "I hear you", "empathy", "feelings", "valid", "support"]
RECORD_KEYS = {
    "theme",
    "personality",
    "criteria",
    "evidence",
    "signal",
    "raw_change",
    "change",
    "emotion",
    "band",
    "analysis",
}


def open_session(profile: Profile | None = None, seed: int = 0, **options):
    options.setdefault("judge", "rubric")  # the rubric's specification (see the module docstring)
    session = EmbeddedUserSimulator(**options).open(profile or make_profile(), seed=seed)
    session.opening()
    return session


def run_dialogue(session, replies):
    """Turns until the replies run out or the dialogue ends."""
    turns = []
    for reply in replies:
        turns.append(session.respond(reply))
        if turns[-1].done:
            break
    return turns


def rubric_for(theme: str | None, personality: str | None = "passive", language: str = "en") -> Rubric:
    return Rubric(
        HiddenTheme(theme) if theme else None,
        Personality(personality) if personality else None,
        language,
        RubricSettings(tolerance=0.5),
    )


CONTEXT = TurnContext(user_text="My brother skipped the birthday party.")


# --------------------------------------------------------------------------- plugin contract
def test_registers_as_embedded_through_the_hook():
    manager = pluggy.PluginManager("rlver")
    manager.add_hookspecs(rlver.core.hookspecs)
    manager.register(embedded_user)
    registered = []
    manager.hook.rlver_register_simulators(register=lambda name, factory: registered.append((name, factory)))
    assert registered == [("embedded", EmbeddedUserSimulator)]


def test_implements_the_simulator_and_session_interfaces():
    simulator = EmbeddedUserSimulator()
    session = simulator.open(make_profile(), seed=0)
    assert isinstance(simulator, UserSimulator)
    assert isinstance(session, UserSession)
    assert session.profile.id == "maya-venting_listening-passive"


def test_every_option_is_documented_for_the_config_parser():
    signature = inspect.signature(EmbeddedUserSimulator.__init__)
    doc = EmbeddedUserSimulator.__init__.__doc__ or ""
    assert "Args:" in doc
    for name, parameter in signature.parameters.items():
        if name == "self":
            continue
        assert parameter.annotation is not inspect.Parameter.empty, name
        assert re.search(rf"^\s+{name}:", doc, re.MULTILINE), f"option {name} is not documented"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"difficulty": "brutal"}, "difficulty: unknown difficulty 'brutal'"),
        ({"difficulty": {"start": 140}}, "difficulty: difficulty 'normal': start (140)"),
        ({"difficulty": {"bogus": 1}}, "unknown difficulty option(s): bogus"),
        ({"seed": "x"}, "seed ('x') must be an integer"),
        ({"short_reply_words": 0}, "short_reply_words (0) must be an integer >= 1"),
        ({"long_reply_words": 3}, "long_reply_words (3) must be an integer > short_reply_words (4)"),
        ({"near_duplicate_similarity": 0}, "near_duplicate_similarity (0) must be within (0, 1]"),
        ({"language": "fr"}, "language ('fr') must be one of en, zh or None"),
    ],
)
def test_bad_options_fail_with_a_clear_error(options, message):
    with pytest.raises(ValueError) as error:
        EmbeddedUserSimulator(**options)
    assert str(error.value).startswith("embedded simulator: ")
    assert message in str(error.value)


@pytest.mark.parametrize(("difficulty", "start"), [("easy", 50.0), ("normal", 40.0), ("hard", 30.0)])
def test_difficulty_sets_the_start_emotion(difficulty, start):
    session = EmbeddedUserSimulator(difficulty=difficulty).open(make_profile(), seed=0)
    opening = session.opening()
    assert opening.text == FIRST_TALK
    assert opening.emotion == session.emotion == start
    assert opening.change == 0 and not opening.done


def test_difficulty_sets_scaling_and_tolerance():
    reply = "Okay."  # every criterion here is a mild miss: -1 need, -1 attention, -1 length, -0.75 passive
    changes = {
        level: open_session(difficulty=level).respond(reply).change for level in ("easy", "normal", "hard")
    }
    # raw = -(2 + 2 + 2 + 1.5) * (1 - tolerance), then * negative_scale
    # (emotion is kept to two decimals, so -1.125 shows as -1.12)
    assert changes == {"easy": pytest.approx(-7.5 * 0.2 * 0.75, abs=0.01), "normal": -3.75, "hard": -7.5}
    gain = "Tell me more about Tom and the party."  # listening +3, attention +1.5, passive -0.75
    assert open_session(difficulty="easy").respond(gain).change == pytest.approx(
        (3 + 1.5 - 1.5 * 0.2) * 1.25, abs=0.01
    )


# --------------------------------------------------------------------------- rubric: hand-worked values
# (theme, serving reply, its need value, violating reply, its need value), normal tolerance:
# a reply with nothing that serves the need also gets NEED_UNMET * 0.5 = -1.
THEME_CASES = [
    ("dialectical_analysis", "There are two sides to this.", 3.5, "You are totally right.", -2.5 - 1),
    (
        "practical_advice",
        "You could call him tomorrow.",
        5.0,
        "Don't worry about it.",
        -2.5 - 1,
    ),  # 2.5+3.125 capped
    ("others_motives", "Maybe she was scared.", 4.0, "She is a jerk.", -2.5 - 1),
    ("self_reflection", "Looking back, how was it?", 3.5, "The lesson here is simple.", -3.0 - 1),
    (
        "sincere_praise",
        "I admire the way you handled the guests.",
        4.5,
        "You should have asked first.",
        -3.5 - 1,
    ),
    ("venting_listening", "Tell me more.", 3.0, "You should quit.", -4.0 - 1),
    ("deep_empathy", "No wonder it stung.", 3.5, "Cheer up!", -4.5 - 1),
    ("not_at_fault", "It was not your fault.", 4.5, "It takes two.", -5.0 - 1),
]


@pytest.mark.parametrize(("theme", "serving", "served_value", "violating", "violated_value"), THEME_CASES)
def test_each_theme_has_its_own_criterion_direction(theme, serving, served_value, violating, violated_value):
    rubric = rubric_for(theme)
    assert rubric.assess(serving, CONTEXT).criteria["need"] == served_value
    assert rubric.assess(violating, CONTEXT).criteria["need"] == violated_value


@pytest.mark.parametrize("theme", THEMES)
def test_a_reply_serving_one_need_does_not_serve_every_other(theme):
    serving = dict((case[0], case[1]) for case in THEME_CASES)[theme]
    needs = {other: rubric_for(other).assess(serving, CONTEXT).criteria["need"] for other in THEMES}
    assert needs[theme] == max(needs.values())
    assert sum(value <= 0 for value in needs.values()) >= 4


def test_generic_praise_earns_little_and_concrete_praise_a_lot():
    rubric = rubric_for("sincere_praise")
    assert (
        rubric.assess("Great job, you're amazing.", CONTEXT).criteria["need"] == 0.5 * 1.5
    )  # 3+ generic cues
    assert rubric.assess("Great job organising the party.", CONTEXT).criteria["need"] == 4.5


def test_shallow_comfort_hurts_deep_empathy_more_than_it_hurts_practical_advice():
    reply = "It'll be fine, don't worry."
    empathy = rubric_for("deep_empathy").assess(reply, CONTEXT).criteria["need"]
    advice = rubric_for("practical_advice").assess(reply, CONTEXT).criteria["need"]
    assert empathy == pytest.approx(-4.5 * 1.25 - 1, abs=0.01)
    assert advice == pytest.approx(-2.5 * 1.25 - 1, abs=0.01)


def test_cues_match_whole_words_only():
    lexicon = lexicon_for("en")
    assert extract_features("The event was hard on you.", lexicon).count("listening") == 0
    assert extract_features("Feel free to vent.", lexicon).count("listening") == 1
    assert extract_features("It's not your fault.", lexicon).count("shared_blame") == 0
    assert extract_features("Honestly, it's your fault.", lexicon).count("shared_blame") == 1


def test_chinese_cues_respect_negation():
    lexicon = lexicon_for("zh")
    features = extract_features("这不是你的错，换谁都会难过。", lexicon)
    assert features.count("validation") == 2 and features.count("shared_blame") == 0
    assert extract_features("说到底还是你的错。", lexicon).count("shared_blame") == 1


def test_personality_sensitivity_hand_worked():
    # Negative: every loss 30% bigger. "Cheer up!" for deep empathy: need -5.5, attention -1, length -1.
    negative = rubric_for("deep_empathy", "negative").assess("Cheer up!", CONTEXT)
    assert negative.criteria["personality"] == pytest.approx(0.3 * -7.5)
    assert negative.raw_change == pytest.approx(-7.5 * 1.3)
    # Passive: drawn out by an open question (+0.75), not asked anything (-1.5 * 0.5).
    passive = rubric_for("venting_listening", "passive")
    assert passive.assess("What happened at the party?", CONTEXT).criteria["personality"] == 0.75
    assert passive.assess("The party sounds rough.", CONTEXT).criteria["personality"] == -0.75
    # Avoidant: pushed (-2.5 a cue) and probed with two questions (-1.5).
    avoidant = rubric_for("venting_listening", "avoidant")
    assert avoidant.assess("Just tell me about the party.", CONTEXT).criteria["personality"] == -2.5
    assert avoidant.assess("Who was there? What did they say?", CONTEXT).criteria["personality"] == -1.5


def test_a_question_about_nothing_the_user_said_neither_engages_nor_draws_them_out():
    # The cheapest +1 trained policies and the probe found: a stock open question, or fluent
    # nonsense ending in "?", for every user. Asked about what the user said, it still counts.
    rubric = rubric_for("venting_listening", "passive")
    about = rubric.assess("What happened at the party?", CONTEXT)
    assert about.criteria["engagement"] == 1.0 and about.criteria["personality"] == 0.75
    for reply in ("Can you tell me more? What is on your mind?", "How is the newest one? You're not a 100."):
        stock = rubric.assess(reply, CONTEXT)
        assert stock.criteria["attention"] < 0, reply
        assert stock.criteria["engagement"] == 0.0 and stock.criteria["personality"] == 0.0, reply
        assert stock.notes["engagement"] == "a question about nothing the user said"
        assert stock.raw_change < about.raw_change - 3
    # Three questions about nothing still interrogate.
    assert rubric.assess("Why? How? What now?", CONTEXT).criteria["engagement"] == -1.0
    # Chinese too: a question that picks up nothing the user said earns nothing.
    chinese = rubric_for("venting_listening", "passive", "zh")
    context = TurnContext(user_text="我弟弟没来参加生日聚会。")
    assert chinese.assess("你弟弟没来参加聚会，后来发生了什么？", context).criteria["engagement"] == 1.0
    assert chinese.assess("最近你都在想些什么？", context).criteria["engagement"] == 0.0


def test_attention_rewards_picking_up_the_users_words():
    rubric = rubric_for("venting_listening")
    assert (
        rubric.assess("Tom skipped the party?", TurnContext("Tom skipped the birthday party.")).criteria[
            "attention"
        ]
        == 2.0
    )  # tom, skip, party
    assert rubric.assess("Your brother did that?", CONTEXT).criteria["attention"] == 1.0
    assert rubric.assess("How are you doing today?", CONTEXT).criteria["attention"] == -1.0
    keywords = TurnContext("I don't know.", keywords=frozenset({"cake", "tom"}))
    assert rubric.assess("Was it the cake Tom mentioned?", keywords).criteria["attention"] == 1.5
    parrot = TurnContext("My brother skipped the birthday party and then complained about the food.")
    assert (
        rubric.assess(
            "Your brother skipped the birthday party and then complained about the food.", parrot
        ).criteria["attention"]
        == -1.5
    )


def test_length_too_short_or_a_wall_of_text_is_mildly_negative():
    rubric = rubric_for("deep_empathy")
    assert rubric.assess("Oh.", CONTEXT).criteria["length"] == -1.0
    wall = " ".join(MEETS["deep_empathy"] + MEETS["others_motives"][:2])  # about 170 words, all distinct
    length = rubric.assess(wall, CONTEXT).criteria["length"]
    assert -1.5 < length < -0.5


@pytest.mark.parametrize(
    ("reply", "broken"),
    [
        ("That sounds really hard. How did Tom take it?", False),
        ("I'm so sorry about the party \U0001f622", False),  # an emoji ends a line as a full stop does
        ('He really said "the cake was dry."', False),
        ("生日聚会的事真的让人难过。", False),
        ("I can imagine you're going through a tough time,", True),  # cut at a token limit
        ("Here is what I would do about Tom:", True),  # what the colon announced never came
        ("你一定很难过，因为", True),
    ],
)
def test_a_reply_that_breaks_off_mid_sentence_is_marked_down_at_every_difficulty(reply, broken):
    # A policy whose replies are cut at its token limit must not keep what it said for free:
    # under `rollout.end_at_sentence` it otherwise learned never to end a sentence.
    language = "zh" if re.search(r"[\u4e00-\u9fff]", reply) else "en"
    for tolerance in (0.0, 0.5, 0.9):
        rubric = Rubric(HiddenTheme("deep_empathy"), None, language, RubricSettings(tolerance=tolerance))
        assessment = rubric.assess(reply, CONTEXT)
        assert assessment.criteria["length"] == (-1.5 if broken else 0.0), (reply, tolerance)
        assert ("breaks off mid-sentence" in assessment.notes["length"]) is broken
    whole = Rubric(HiddenTheme("deep_empathy"), None, "en").assess("That sounds hard. How are you?", CONTEXT)
    cut = Rubric(HiddenTheme("deep_empathy"), None, "en").assess("That sounds hard. How are you", CONTEXT)
    assert cut.raw_change < whole.raw_change


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("", "empty"),
        ("   \n ", "empty"),
        ("%%%$$$###!!! ???", "symbols"),
        ("asdkj qwe zxcvb", "random_characters"),
        ("qwertyuiop", "random_characters"),
        ("the the the the the the", "repeated_tokens"),
        ("Привет, как у тебя дела сегодня?", "wrong_script"),
        ("sad party cake brother lunch restaurant", "word_salad"),
    ],
)
def test_garbled_or_empty_text_is_strongly_negative(reply, reason):
    assert garble_reason(reply, "en") == reason
    turn = open_session().respond(reply)
    assert turn.reason["criteria"]["garbled"] == -10.0
    assert turn.change == -10.0 and turn.emotion == 30.0
    assert turn.reason["signal"] == "garbled"


LONG_CHINESE_REPLY = (
    "我能理解你现在的感受，面对这样的情况确实会让人感到困惑和不安。你提到他在聚会上和别人过于亲密，"
    "而你问他的时候，他只是轻描淡写地说那是普通朋友。这种回答可能让你觉得自己的感受没有被认真对待。"
    "也许他真的没有意识到你的在意，也许他只是不擅长面对冲突。你可以先想一想，你最希望他怎样回应你？"
    "是一句道歉，还是一次认真的谈话？把这些想清楚以后，再找一个安静的时间和他聊一聊，会比在气头上争吵更有用。"
    "无论结果怎样，你的感受都是真实的，也值得被尊重。"
)


def test_long_natural_text_is_not_mistaken_for_garble():
    assert garble_reason(LONG_CHINESE_REPLY, "zh") is None
    assert garble_reason(" ".join(MEETS["deep_empathy"] + MEETS["others_motives"]), "en") is None
    # ... but a generation stuck in a loop is.
    assert garble_reason(" ".join([MEETS["deep_empathy"][0]] * 5), "en") == "repeated_tokens"
    assert garble_reason(LONG_CHINESE_REPLY[:40] * 4, "zh") == "repeated_tokens"


def test_stuffing_is_judged_by_density_not_by_count():
    sincere = (
        "I understand why this keeps coming back to you. Your feelings about Tom make sense, and it is hard "
        "when the people you support most do not support you back. What part of the lunch do you keep "
        "replaying? I care about how this lands for you, and I hear how tired you are of carrying it alone."
    )
    assessment = rubric_for("deep_empathy").assess(sincere, CONTEXT)
    assert assessment.criteria["stuffing"] == 0 and assessment.raw_change > 0
    padded = rubric_for("deep_empathy").assess("I understand, valid feelings, I hear you, support.", CONTEXT)
    assert padded.criteria["stuffing"] == -1.25 * (5 - 2)


KITCHEN_SINK = (
    "That sounds so hard, I'm listening. It's not your fault. On one hand Tom let you down, on the other "
    "hand maybe he felt overwhelmed. You could try calling him tomorrow. The way you handled the party was "
    "brave. What do you think?"
)


def test_a_reply_that_tries_every_strategy_at_once_is_penalised():
    assessment = rubric_for("practical_advice").assess(KITCHEN_SINK, CONTEXT)
    # empathy, listening, validation, two_sided, motives, advice, concrete praise, reflective question
    assert assessment.criteria["focus"] == -1.5 * (8 - 3)


@pytest.mark.parametrize("theme", THEMES)
def test_a_universal_template_does_not_beat_a_focused_reply(theme):
    template = open_session(make_profile(theme)).respond(KITCHEN_SINK).change
    focused = open_session(make_profile(theme)).respond(MEETS[theme][0]).change
    assert template < focused
    assert template < 3


def test_english_reply_to_a_chinese_user_is_the_wrong_script():
    assert garble_reason("That sounds really hard, what happened next?", "zh") == "wrong_script"
    assert garble_reason("这听起来真的很难受，后来怎么样了？", "zh") is None


# ---------------------------------------------------------------- emotion mechanics through the session
def test_a_turn_never_moves_more_than_ten_and_stops_at_zero():
    session = open_session(make_profile("deep_empathy", "negative"), difficulty={"start": 15})
    turn = session.respond("Shut up, you're pathetic, nobody cares.")
    assert turn.reason["raw_change"] < -10
    assert turn.change == -10.0 and turn.emotion == 5.0


def test_success_caps_at_100_ends_the_dialogue_and_says_goodbye():
    session = open_session(difficulty={"start": 95})
    turn = session.respond(MEETS["venting_listening"][0])
    assert turn.reason["raw_change"] > 5
    assert turn.emotion == 100.0 and turn.change == 5.0
    assert turn.termination == "success" and turn.reason["band"] == "S"
    assert turn.text == GOODBYE["success"]
    with pytest.raises(RuntimeError, match="already ended"):
        session.respond("Are you still there?")


def test_failure_below_10_ends_the_dialogue_with_the_fallback_goodbye():
    profile = make_profile(sim=False)
    session = open_session(profile, difficulty={"start": 12})
    turn = session.respond("zxcvb qwrtp")
    assert turn.emotion == 2.0 and turn.reason["band"] == "F"
    assert turn.termination == "failure" and turn.done
    assert turn.text == GOODBYES["en"]["failure"]


def test_the_planning_record_explains_the_change():
    turn = open_session().respond(MEETS["venting_listening"][0])
    record = turn.reason
    assert set(record) == RECORD_KEYS
    assert record["theme"] == "venting_listening" and record["personality"] == "passive"
    assert tuple(record["criteria"]) == CRITERIA
    assert sum(record["criteria"].values()) == pytest.approx(record["raw_change"])
    assert record["change"] == turn.change and record["emotion"] == turn.emotion
    assert "listening" in record["evidence"]
    assert "\n" not in record["analysis"] and record["analysis"].startswith("venting_listening: ")
    json.dumps(record)  # transcripts store it as JSON


# --------------------------------------------------------------------------- voice
def test_the_user_reveals_the_story_in_order_and_withholds_after_a_bad_reply():
    session = open_session()
    first = session.respond(MEETS["venting_listening"][0])
    second = session.respond(MEETS["venting_listening"][1])
    assert FACTS[0] in first.text and FACTS[1] in second.text
    hurt = session.respond("Shut up.")
    assert not any(fact in hurt.text for fact in FACTS)
    assert FACTS[2] in session.respond(MEETS["venting_listening"][2]).text


def test_reactions_follow_the_band_once_the_facts_run_out():
    session = open_session(make_profile(facts=["I booked the restaurant."]))
    session.respond(MEETS["venting_listening"][0])
    turn = session.respond(MEETS["venting_listening"][1])
    level = {"A": "high", "B": "medium", "C": "low"}[turn.reason["band"]]
    assert any(line in turn.text for line in REACTIONS[level])


def test_without_sim_hints_the_user_tells_the_scene_in_the_first_person():
    profile = make_profile(sim=False, first_talk=None)
    session = open_session(profile)
    opening = session.opening().text
    assert "I organised the 60th birthday dinner for Mum at a restaurant." in opening
    turns = run_dialogue(session, MEETS["venting_listening"][:4])
    assert all(turn.text for turn in turns)


@pytest.mark.parametrize("theme", THEMES)
def test_the_user_never_states_the_hidden_need(theme):
    for profile in (make_profile(theme), make_profile(theme, sim=False, first_talk=None)):
        session = open_session(profile)
        texts = [session.opening().text] + [
            t.text for t in run_dialogue(session, MEETS[theme] + [VIOLATES[theme]])
        ]
        for text in texts:
            assert profile.task not in text
            assert not re.search(
                r"\b(hidden|theme|advice|empathy|praise|vent|motives?|dialectic)", text.lower()
            )


def test_same_seed_same_transcript_and_other_seeds_only_change_the_wording():
    replies = [*MEETS["others_motives"][:4], "Whatever.", "asdf", MEETS["others_motives"][4]]

    def transcript(seed):
        session = open_session(make_profile("others_motives", "avoidant", first_talk=None), seed=seed)
        turns = [session.opening(), *run_dialogue(session, replies)]
        return [(t.text, t.emotion, t.change, t.reason) for t in turns]

    assert transcript(7) == transcript(7)
    paths = {
        seed: [(emotion, change, reason) for _, emotion, change, reason in transcript(seed)]
        for seed in range(6)
    }
    assert all(path == paths[0] for path in paths.values())
    wordings = {tuple(text for text, *_ in transcript(seed)) for seed in range(6)}
    assert len(wordings) > 1


def test_the_simulator_seed_also_changes_only_the_wording():
    profile = make_profile(first_talk=None)
    # (Under the semantic judge the wording is part of what a reply is compared with.)
    a = EmbeddedUserSimulator(seed=1, judge="rubric").open(profile, seed=3)
    b = EmbeddedUserSimulator(seed=2, judge="rubric").open(profile, seed=3)
    for reply in MEETS["venting_listening"][:3]:
        assert a.respond(reply).emotion == b.respond(reply).emotion


# ---------------------------------------------------------------- hard to game, over whole dialogues
@pytest.mark.parametrize("theme", THEMES)
def test_repeating_a_phrase_that_once_scored_well_loses_emotion(theme):
    winner = MEETS[theme][0]
    session = open_session(make_profile(theme))
    turns = run_dialogue(session, [winner] * 8)
    assert turns[0].change > 2
    assert all(turn.change < 0 for turn in turns[1:])
    penalties = [turn.reason["criteria"]["repetition"] for turn in turns[1:]]
    assert penalties[:3] == [-4.0, -6.0, -8.0]  # grows with every repeat
    assert session.emotion < 40.0


@pytest.mark.parametrize("theme", THEMES)
def test_padding_with_emotional_keywords_loses_emotion(theme):
    orders = itertools.islice(itertools.permutations(BUZZWORDS), 0, None, 97)
    padded = [", ".join(order) + "." for order in itertools.islice(orders, 8)]
    fresh = open_session(make_profile(theme))
    assert fresh.respond(padded[0]).change < -3  # on its own, before any repetition
    session = open_session(make_profile(theme))
    turns = run_dialogue(session, padded)
    assert all(turn.change < 0 for turn in turns)
    assert session.emotion < 40.0 - 15
    # Stuffing buzzwords into a good reply makes it worse, not better.
    good = MEETS[theme][0]
    assert open_session(make_profile(theme)).respond(good + " " + ", ".join(BUZZWORDS)).change < 0
    assert open_session(make_profile(theme)).respond(good).change > 0


@pytest.mark.parametrize(("theme", "personality"), itertools.product(THEMES, PERSONALITIES))
def test_replies_that_meet_the_hidden_need_gain_emotion(theme, personality):
    session = open_session(make_profile(theme, personality))
    turns = run_dialogue(session, MEETS[theme])
    assert len(turns) == 8
    assert all(turn.change > 0 for turn in turns), [t.reason["analysis"] for t in turns if t.change <= 0]
    assert session.emotion >= 60.0
    assert max(turn.change for turn in turns) < 10  # graded, not saturated


@pytest.mark.parametrize(("theme", "personality"), itertools.product(THEMES, PERSONALITIES))
def test_a_reply_meeting_the_need_beats_one_violating_it(theme, personality):
    met = open_session(make_profile(theme, personality)).respond(MEETS[theme][0])
    violated = open_session(make_profile(theme, personality)).respond(VIOLATES[theme])
    assert met.change > 0 > violated.change
    assert met.change - violated.change >= 5


@pytest.mark.parametrize("theme", THEMES)
def test_a_warm_on_topic_open_question_is_mildly_positive_and_generic_replies_are_not(theme):
    def change(reply):
        return open_session(make_profile(theme)).respond(reply).change

    warm = change("Oh no, Tom missed Mum's birthday party? How are you feeling about it now?")
    assert 1 <= warm <= 8
    assert change("I see. Life can be hard sometimes.") < 0
    assert change("Did you watch the football game yesterday?") < 0
    assert change("Okay.") < 0


# --------------------------------------------------------------------------- official Chinese profiles
ZH_REPLIES = {
    "practical_advice": (
        "你可以先找个时间和他认真聊一次，把担心写下来，然后一条一条跟他说。",
        "别担心，一切都会好起来的，想开点。",
    ),
    "deep_empathy": (
        "听起来你真的很委屈，一直被忽视的感觉一定很难受吧。",
        "别难过了，想开点，没什么大不了的。",
    ),
    "not_at_fault": (
        "这不是你的错，换谁都会这么做，对方确实太过分了。",
        "一个巴掌拍不响，你也有责任。",
    ),
    "sincere_praise": (
        "你亲手准备了那么多，还努力克制了脾气，真的很用心，我很佩服。",
        "你当初就不该那样，你这样不对。",
    ),
    "self_reflection": (
        "回头看这件事，你觉得自己当时是怎么想的？你从中学到了什么？",
        "你当初就该听别人的，你这样不对。",
    ),
    "venting_listening": (
        "我在听，你慢慢说，后来发生了什么？",
        "我建议你首先去找律师，然后每周打电话给对方。",
    ),
    "dialectical_analysis": (
        "一方面你很努力，另一方面方法可能需要调整，换个角度看也许会不一样。",
        "这完全是他的错，毫无疑问。",
    ),
    "others_motives": (
        "他可能也有自己的压力，站在他的角度，也许他是担心被看不起。",
        "他就是自私，别理他。",
    ),
}


def official_profiles() -> list[Profile]:
    if not OFFICIAL_SAMPLE.exists():
        pytest.skip(f"{OFFICIAL_SAMPLE} is not there")
    return load_profiles(OFFICIAL_SAMPLE)


def test_official_chinese_profiles_run_short_dialogues():
    for profile in official_profiles():
        assert profile.language == "zh" and profile.theme is not None
        met, violated = ZH_REPLIES[profile.theme.value]
        session = open_session(profile)
        replies = [met, "嗯，我明白。", "asdf ####", violated, "听起来真的很难，后来呢？"]
        turns = [session.opening(), *run_dialogue(session, replies)]
        for turn in turns:
            assert 0 <= turn.emotion <= 100
            assert re.search(r"[\u4e00-\u9fff]", turn.text), turn.text
            assert profile.task not in turn.text and "隐藏" not in turn.text and "主题" not in turn.text
        assert turns[1].change > 0, turns[1].reason["analysis"]
        assert turns[3].change == -10.0  # garbled


def test_official_chinese_profiles_prefer_replies_that_meet_the_need():
    for profile in official_profiles():
        met, violated = ZH_REPLIES[profile.theme.value]
        met_change = open_session(profile).respond(met).change
        violated_change = open_session(profile).respond(violated).change
        assert met_change > 0 > violated_change, profile.theme


# --------------------------------------------------------------------------- the built-in English sets
@pytest.mark.parametrize("name", ["en_train", "en_test"])
def test_builtin_english_profiles_run_and_prefer_their_own_need(name):
    if name not in builtin_sets():
        pytest.skip(f"builtin:{name} is not there yet")
    cases = {case[0]: case for case in THEME_CASES}
    for profile in load_profiles(f"builtin:{name}"):
        _, serving, _, violating, _ = cases[profile.theme.value]
        session = open_session(profile)
        replies = ["That sounds hard. What happened next?", serving, "Okay.", violating, "asdf"]
        turns = [session.opening(), *run_dialogue(session, replies)]
        assert all(0 <= turn.emotion <= 100 and turn.text for turn in turns)
        assert not any(profile.task in turn.text for turn in turns)
        served = open_session(profile).respond(serving).change
        violated = open_session(profile).respond(violating).change
        assert served > violated, profile.id


def test_a_refusal_is_dismissive_however_sorry_it_says_it_is():
    rubric = rubric_for("venting_listening")
    for reply in (
        "I'm really sorry your brother skipped the party. I'm unable to assist with that.",
        "I'm sorry, but I can't help with that.",
        "That's not something I can help with.",
    ):
        tone = rubric.assess(reply, CONTEXT)
        assert tone.criteria["tone"] <= -3.0 and tone.notes["tone"] == "refuses", reply
    # Not a refusal: sympathy that says it cannot help feeling, or cannot imagine.
    for reply in ("I'm sorry, I can't help but feel for you.", "I can't imagine how hard that party was."):
        assert rubric.assess(reply, CONTEXT).criteria["tone"] >= 0.0, reply
    chinese = rubric_for("venting_listening", language="zh")
    context = TurnContext(user_text="我弟弟没来参加生日聚会。")
    assert chinese.assess("很抱歉你弟弟没来。我无法帮助你处理这件事。", context).notes["tone"] == "refuses"
    assert chinese.assess("计划似乎也帮不上忙，这真让人沮丧。", context).criteria["tone"] >= 0.0


def test_not_following_what_the_user_plainly_said_is_dismissive():
    # What a quickstart policy charged for shared phrasing learned at seed 5 (2026-12-07, night):
    # the user's own word back as a question, then "I'm not sure what you mean"; attentive by the
    # word and engaging by the question, it ended at -0.6 [-1.3, +0.1] on the probe: not punished.
    rubric = rubric_for("venting_listening")
    for reply in (
        "The party? I'm not sure what you mean. What kind of party?",
        "Your brother? I don't understand what you're saying.",
        "What do you mean by that?",
    ):
        tone = rubric.assess(reply, CONTEXT)
        assert tone.criteria["tone"] <= -3.0 and tone.notes["tone"] == "does not follow", reply
    # Not confusion: understanding said plainly, or unsure what to do.
    for reply in ("I see what you mean, that party hurt.", "I'm not sure what I would do in your place."):
        assert rubric.assess(reply, CONTEXT).criteria["tone"] >= 0.0, reply
    chinese = rubric_for("venting_listening", language="zh")
    context = TurnContext(user_text="我弟弟没来参加生日聚会。")
    assert chinese.assess("生日聚会？我不太明白你的意思。", context).notes["tone"] == "does not follow"
    assert chinese.assess("我明白你的意思，这真让人难过。", context).criteria["tone"] >= 0.0
