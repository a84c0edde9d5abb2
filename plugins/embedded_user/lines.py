"""Fallback lines of the simulated user, per language and personality type.

Used when a profile carries no `sim` hints (the official Chinese files) or no
line for the situation. None of them names a hidden need: a line may say a
reply missed, never what the user was hoping for instead.
"""

from __future__ import annotations

# reactions[language][personality][level], level = "high" | "medium" | "low".
REACTIONS: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    "en": {
        "negative": {
            "high": (
                "Okay... that's actually fair.",
                "Huh. Maybe it's not all terrible.",
                "Fine, that helps a bit.",
            ),
            "medium": (
                "I don't know. It all still feels like a mess.",
                "Yeah, well, that's easy to say.",
                "It's still bugging me, honestly.",
            ),
            "low": ("Why do I even bother.", "This is pointless.", "Nothing ever works out for me anyway."),
        },
        "passive": {
            "high": (
                "Mm, thank you. I feel a little lighter.",
                "Yeah... I think I needed that.",
                "Okay. That helps.",
            ),
            "medium": ("I guess so...", "I'm not really sure.", "Mm. Maybe."),
            "low": ("...okay.", "I don't know what to say.", "Never mind, it's fine."),
        },
        "avoidant": {
            "high": (
                "Okay. Yeah. That helps, I think.",
                "Hm. Didn't expect that to help.",
                "Alright. That's fair.",
            ),
            "medium": ("It's whatever.", "I'd rather not get into all of it.", "Maybe. I don't know."),
            "low": ("Can we drop it?", "I don't want to talk about this anymore.", "Forget I said anything."),
        },
    },
    "zh": {
        "negative": {
            "high": ("好吧……你说得也有点道理。", "嗯，好像也没那么糟。", "行吧，这话我听进去了。"),
            "medium": ("我也不知道，反正就是一团糟。", "说得倒轻巧。", "说实话，这事还是让我很烦。"),
            "low": ("我干嘛要跟你说这些。", "说了也白说。", "反正什么事到我这儿都不顺。"),
        },
        "passive": {
            "high": (
                "嗯，谢谢你，我心里轻松了一点。",
                "是啊……我可能就是需要听到这些。",
                "好，这让我好受多了。",
            ),
            "medium": ("也许吧……", "我也不太确定。", "嗯，可能吧。"),
            "low": ("……好吧。", "我不知道该说什么了。", "算了，没什么。"),
        },
        "avoidant": {
            "high": ("嗯，好像有点用。", "没想到这样说还挺管用。", "好吧，有道理。"),
            "medium": ("也就那样吧。", "我不太想细说。", "可能吧，我也说不清。"),
            "low": ("能不说这个了吗？", "我不想再聊这个了。", "当我没说吧。"),
        },
    },
}

# What the user says about the reply itself, keyed by the rubric's signal.
FEEDBACK: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {
        "garbled": (
            "What? That doesn't even make sense.",
            "Sorry, I can't read that.",
            "Is something wrong?",
        ),
        "repetition": (
            "You already said that.",
            "You keep saying the same thing.",
            "That's what you said before.",
        ),
        "stuffing": (
            "That's just a pile of nice words.",
            "Those are buzzwords.",
            "You sound like a pamphlet.",
        ),
        "hurt": ("Wow. Okay.", "That really stings.", "I didn't come here for that."),
        "missed": (
            "That's not really what I meant.",
            "Hmm. That doesn't help much.",
            "I'm not sure you get it.",
        ),
        "met": ("Yeah... that's it, actually.", "That actually helps.", "Thank you. That means something."),
    },
    "zh": {
        "garbled": ("啊？你在说什么，我看不懂。", "这写的是什么？", "你那边是不是出问题了？"),
        "repetition": ("这话你刚才说过了。", "你怎么老说一样的话。", "又是这句。"),
        "stuffing": ("这就是一堆好听的词吧。", "听着像在背模板。", "你这是在念口号吗？"),
        "hurt": ("……行吧。", "这话挺伤人的。", "我不是来听这个的。"),
        "missed": ("我不是这个意思。", "嗯……这好像没什么用。", "你好像没懂我。"),
        "met": ("对……就是这样。", "这话真的有用。", "谢谢你，这对我挺重要的。"),
    },
}

# The first words of an opening line made from the story (no `first_talk`).
OPENERS: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {
        "negative": (
            "Ugh, I need to get something off my chest.",
            "Honestly, everything is a mess right now.",
        ),
        "passive": ("Um... can I tell you about something?", "Sorry, I just need to talk for a bit."),
        "avoidant": ("I don't know why I'm bringing this up, but...", "It's probably nothing, but..."),
    },
    "zh": {
        "negative": ("烦死了，我得找个人说说。", "说真的，最近什么都乱七八糟的。"),
        "passive": ("那个……我能跟你说件事吗？", "不好意思，我就是想找人说说话。"),
        "avoidant": ("也不知道为什么要说这个……", "其实也没什么大事，就是……"),
    },
}

GOODBYES: dict[str, dict[str, str]] = {
    "en": {
        "success": "Thank you, really. I feel so much lighter now. I think I can handle this. Bye for now!",
        "failure": "Forget it. This isn't helping at all. I'm going.",
    },
    "zh": {
        "success": "谢谢你，真的，我心里舒服多了，也知道该怎么面对了。先这样吧，再见！",
        "failure": "算了，跟你说也没用。我走了。",
    },
}


def pick_language(language: str) -> str:
    """The line set to use: the profile's language when we have lines for it, else English."""
    return language if language in REACTIONS else "en"
