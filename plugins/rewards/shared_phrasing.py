"""A cost for a reply phrased as the replies to other users are: a template, seen across a batch.

A simulated user sees one dialogue, so it cannot tell that every other user got the same words
("I'm here, Ron. I'm here, Ron.", "Kyoto? I'm not sure what you mean. What kind of chef?"): a
template costs nothing there, and trained quickstart policies put one opening on up to every
greedy reply (docs/results.md). The batch does see it.

A template is what is left of a reply once the user's own words are taken out. So each reply is
first stripped of the words (characters, in Chinese) its user said and no other user of the batch
did (names, places, the story's things), each replaced by one placeholder; then it is charged, over
its phrases (every three words, or four characters in Chinese: `rlver.core.wording.phrases`), the
mean share of the replies to *other* users that use the phrase too: per turn, minus that mean.
A reply in words of its own costs about nothing; "I'm here, _. I'm here, _." said to every user
costs the reward's weight. Replies to the same user are left out of the share: a group's samples
answer one user in one context, and agreeing among themselves is no template.

Why not the opening alone: charged for its first three words (a first version), the quickstart
policy at seed 5 went from "I'm glad ..." on every greedy reply to "Kyoto? I'm not sure what you
mean. What kind of chef?": a new opening per user, the same template behind it (docs/results.md).

The batch is the one the trainer scores at once: the step's dialogues of one rank (no collective
here: a rank with nothing to generate scores placeholders and must not wait on the others).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rlver.core.interfaces import RewardFunction
from rlver.core.trajectory import Trajectory
from rlver.core.wording import is_chinese, phrases, units

SLOT = "_"  # where a word of the user's own stood


class SharedPhrasingCost(RewardFunction):
    """Per policy turn: minus the mean, over the reply's phrases once the user's own words are
    taken out, of the share of the other users' replies that use the phrase.

    Weigh it beside the emotion reward (`rewards: [final_emotion, {name: shared_phrasing, weight:
    0.05}]`): the emotion reward is the final emotion / 100, so weight 0.05 prices a reply all of
    whose phrases every other user's replies use like five points of emotion.
    """

    def __call__(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        users = [t.profile.id for t in trajectories]
        heard: dict[str, set[str]] = {}  # every word each user said, over their dialogues
        for user, t in zip(users, trajectories, strict=True):
            heard.setdefault(user, set()).update(w for turn in t.user_turns for w in units(turn.text))
        own_words = {
            user: words - set().union(*(other for name, other in heard.items() if name != user))
            for user, words in heard.items()
        }
        said = [
            [skeleton_phrases(turn.parsed.visible, own_words[user]) for turn in t.policy_turns]
            for user, t in zip(users, trajectories, strict=True)
        ]
        replies_to: Counter[str] = Counter()
        uses: dict[str, Counter[str]] = {}  # per user: how many replies to them use each phrase
        for user, replies in zip(users, said, strict=True):
            replies_to[user] += len(replies)
            counts = uses.setdefault(user, Counter())
            for reply in replies:
                counts.update(reply)
        everyone = sum(uses.values(), Counter())
        total = sum(replies_to.values())
        scores = []
        for user, replies in zip(users, said, strict=True):
            others, own = total - replies_to[user], uses[user]
            scores.append([
                -sum(everyone[p] - own[p] for p in reply) / (len(reply) * others) if reply and others else 0.0
                for reply in replies
            ])  # fmt: skip
        return scores


def skeleton_phrases(reply: str, own_words: set[str]) -> set[str]:
    """The reply's phrases with each of `own_words` (the user's, no one else's) as one SLOT."""
    joiner = "" if is_chinese(reply) else " "
    kept = [SLOT if word in own_words else word for word in units(reply)]
    return phrases(joiner.join(kept)) if kept else set()
