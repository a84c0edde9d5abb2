"""benchmarks/step_floor.py: counting a step's work from its transcripts, as the policy's template lays it out."""

from __future__ import annotations

import json
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import step_floor


def dialogue(step: int, profile: str, opening: str, replies: list[tuple[str, int]], answer: str) -> dict:
    turns = [{"role": "user", "text": opening}]
    for index, (text, tokens) in enumerate(replies):
        turns.append({"role": "assistant", "text": text, "num_tokens": tokens})
        if index < len(replies) - 1:
            turns.append({"role": "user", "text": answer})
    return {"step": step, "profile_id": profile, "system_prompt": "Be kind.", "turns": turns}


def test_a_groups_first_prompt_is_prefilled_once_and_every_token_is_counted(tmp_path):
    from transformers import AutoTokenizer

    from rlver.modeling.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))

    def length(messages, prompt):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    replies = [("I hear you.", 5), ("What happened next?", 6)]
    group = [dialogue(0, "p1", "My dog is ill.", replies, "She will not eat.") for _ in range(2)]
    other = dialogue(0, "p2", "Work is hard.", replies, "My boss shouts.")
    path = tmp_path / "train_rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*group, other]))

    tokens = step_floor.step_tokens(path, tokenizer)

    def prompts(record):
        system = [{"role": "system", "content": "Be kind."}]
        first = [*system, {"role": "user", "content": record["turns"][0]["text"]}]
        second = [*first, {"role": "assistant", "content": replies[0][0]}]
        second.append({"role": "user", "content": record["turns"][2]["text"]})
        whole = [*second, {"role": "assistant", "content": replies[1][0]}]
        return length(first, True), length(second, True), length(whole, False)

    (first_a, second_a, whole_a), (first_b, second_b, whole_b) = prompts(group[0]), prompts(other)
    assert tokens["prefill"] == first_a + 2 * second_a + first_b + second_b  # the group's opening once
    assert tokens["decoded"] == 3 * (5 + 6)
    assert tokens["dialogues"] == 3
    assert tokens["whole"] == 2 * whole_a + whole_b
