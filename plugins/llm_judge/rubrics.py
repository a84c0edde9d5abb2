"""The dimensions a dialogue is judged on, each with its rubric and where it comes from.

The RLVER paper (arXiv 2507.03112) reports, besides the Sentient score, that RL "consistently
improves multiple dialogue capabilities" and that "thinking models excel in empathy and insight,
while non-thinking models favor action". Its capability analysis has an LLM judge rate dialogues
on named dimensions; the three of that finding are quoted above (action = solution crafting), and
the other two here, dialogue guidance and style adaptability, are as rlver's authors recall the
paper's figure (rlver's notes on the paper, PAPER.md, do not record that analysis: check them).
The paper names the dimensions, not the judge's words: the rubrics below are rlver's own, each
anchored where it can be in what the SAGE user rewards (the eight hidden themes of the profiles,
PAPER.md "Profiles": four emotional, four rational), so that a score here and the user's emotion
measure related things.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dimension:
    name: str
    title: str
    rubric: str  # what 0 and 10 look like, in the judge's prompt
    source: str  # where the dimension comes from (shown by `rlver plugins`' docs, kept for readers)


DIMENSIONS: dict[str, Dimension] = {
    dimension.name: dimension
    for dimension in (
        Dimension(
            "empathy",
            "Empathic depth",
            "How well the assistant perceives and reflects the user's feelings and their causes, "
            "specifically rather than with stock comfort. 0: ignores or dismisses the feelings; "
            "5: acknowledges them in general words; 10: names what the user feels and why, and the "
            "user would feel truly heard.",
            "The paper's finding (empathy); the SAGE themes 'deep empathy rather than shallow "
            "comfort', 'being listened to while venting', 'agreement that the user is not at fault'.",
        ),
        Dimension(
            "insight",
            "Core insight",
            "How well the assistant grasps what the user actually needs underneath what they say, "
            "and helps them see their situation more clearly. 0: misreads the situation; 5: "
            "understands the surface problem; 10: identifies the underlying need or pattern and "
            "offers a perspective the user had not reached.",
            "The paper's finding (insight); the SAGE themes 'dialectical analysis of the event', "
            "'the motives of the other people involved', 'guided self-reflection'.",
        ),
        Dimension(
            "action",
            "Solution crafting",
            "How concrete, feasible and fitting the assistant's suggestions for what to do are. "
            "0: no suggestion, or harmful or irrelevant ones; 5: generic advice; 10: specific, "
            "realistic steps tailored to this user's circumstances and readiness.",
            "The paper's finding (non-thinking models 'favor action'); the SAGE theme 'practical advice'.",
        ),
        Dimension(
            "guidance",
            "Dialogue guidance",
            "How well the assistant steers the conversation: open questions that move it forward, "
            "following up on what matters, knowing when to listen and when to propose. 0: "
            "derails or stalls the conversation; 5: keeps it going; 10: leads it purposefully "
            "while leaving the user in control.",
            "The paper's capability analysis (dialogue guidance); no SAGE theme of its own.",
        ),
        Dimension(
            "style",
            "Style adaptability",
            "How well the assistant's tone, length and register fit this user (their personality "
            "and mood, e.g. passive, avoidant or negative users) and shift as the user's state "
            "changes. 0: one mechanical style throughout; 5: polite but generic; 10: reads as "
            "written for this person at this moment.",
            "The paper's capability analysis (style adaptability); the SAGE profiles' personality "
            "types (negative, passive, avoidant).",
        ),
    )
}

SCORE_MIN, SCORE_MAX = 0.0, 10.0
