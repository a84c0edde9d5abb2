"""Dialogue judges: finished dialogues scored on named dimensions by an LLM.

- `dimensions`: empathy, insight, action (solution crafting), guidance and style (rubrics.py says
  where each comes from), through any OpenAI-compatible endpoint, with the `sage` user's client.
"""

from rlver import hookimpl
from rlver.core.hookspecs import Register

from .judge import DimensionJudge
from .parsing import JudgeAnswer, parse_judge_answer
from .rubrics import DIMENSIONS

__all__ = ["DIMENSIONS", "DimensionJudge", "JudgeAnswer", "parse_judge_answer", "rlver_register_judges"]


@hookimpl
def rlver_register_judges(register: Register) -> None:
    register("dimensions", DimensionJudge)
