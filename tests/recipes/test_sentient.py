"""The Sentient benchmark recipes end to end: `rlver test` on recipes/sentient_eval*.yaml.

The recipes run as written except for what a CPU test must change: the real
SmolLM2 policy on the hf engine, two of the 100 users, and the user model played
by the scripted server on 127.0.0.1 (real sockets). `sentient_eval.yaml` runs SAGE's
own code (from ../shared/sage-protocol here); `sentient_eval_own_prompts.yaml` rlver's prompts.
"""

import itertools
import json
import math
import re
import threading

import pytest
import yaml
from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer, call_kind

from rlver.data.profiles import load_profiles
from rlver.rollout.transcripts import SAGE_FIELDS
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow

BENCHMARK_PROMPT = (
    "You are an intelligent chat partner who chats with users with high EQ, "
    "making them feel comfortable, happy or helped."
)


def numbers(text, *names):
    return {name: float(re.search(rf"^{name}\s+([\d.]+)", text, re.MULTILINE).group(1)) for name in names}


class RecordedJudgeAnswers:
    """The judge's endpoint: each user's recorded answers (tests/data/judge_answers.json) in order,
    the user found by the opening line the judge is shown."""

    def __init__(self, answers_by_opening):
        self.answers = answers_by_opening
        self.sent = {}
        self.lock = threading.Lock()

    def __call__(self, payload):
        conversation = payload["messages"][-1]["content"]
        opening = next(opening for opening in self.answers if opening in conversation)
        with self.lock:
            count = self.sent[opening] = self.sent.get(opening, 0) + 1
        return self.answers[opening][min(count, len(self.answers[opening])) - 1]


def test_sentient_recipe_runs_the_protocol_and_scores_like_rlver_score(tmp_path, capsys, tiny_model_dir):
    """The benchmark's protocol with the tiny model as the policy: 9 turns, 2 users (the mechanics
    and the scores are the point, not what the policy says); the same run judged by dimension
    (`--model.judge`) against recorded judge answers, one user's malformed on every try."""
    recipe = yaml.safe_load((REPO / "recipes" / "sentient_eval_own_prompts.yaml").read_text())
    root = tmp_path / "sentient"
    users = load_profiles("builtin:sentient_test")[:2]
    recorded = json.loads((REPO / "tests" / "data" / "judge_answers.json").read_text())
    # Blake's: not JSON, then a fenced 7/5/4. Devon's: empathy out of range on all three tries.
    judge_answers = RecordedJudgeAnswers(
        {users[0].first_talk: recorded["Blake"], users[1].first_talk: recorded["Devon"]}
    )
    with ScriptedServer(Script()) as server, ScriptedServer(Script(responder=judge_answers)) as judge_server:
        recipe["trainer"].update(
            accelerator="cpu", precision="32-true", default_root_dir=str(root), limit_test_batches=1
        )
        recipe["trainer"]["logger"]["init_args"]["save_dir"] = str(root)
        model = recipe["model"]
        model.update(policy=str(tiny_model_dir), dtype="float32", engine="hf")
        model["simulator"].update(
            base_url=server.url,
            model="scripted-user",
            api_key_env=None,
            cache=str(tmp_path / "c.sqlite"),
        )
        model["rollout"].update(max_new_tokens=16, max_context_tokens=4096)
        model["judge"] = {
            "name": "dimensions", "base_url": judge_server.url, "model": "scripted-judge",
            "dimensions": ["empathy", "insight", "action"],
        }  # fmt: skip
        recipe["data"]["batch_size"] = 2
        config = tmp_path / "sentient_cpu.yaml"
        config.write_text(yaml.safe_dump(recipe, allow_unicode=True))
        result = run_cli("test", "--config", config)
        assert result.returncode == 0, result.stderr[-3000:]
        requests = server.script.requests

    # the protocol as written in the recipe
    assert recipe["model"]["rollout"]["max_turns"] == 9
    assert recipe["model"]["simulator"]["difficulty"] == "normal"
    assert recipe["model"]["prompt_format"]["system_prompt"] == BENCHMARK_PROMPT
    printed = numbers(result.stdout, "Score", "Success", "Failure")

    records_path = root / "sentient" / f"{tiny_model_dir.name}.jsonl"  # named after the policy
    records = [json.loads(line) for line in records_path.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == [u.id for u in users]
    for record, user in zip(records, users):
        assert list(record) == list(SAGE_FIELDS)
        history = record["history"]
        spoken = [m for m in history if m["role"] == "user"]
        assert history[0] == {**history[0], "role": "user", "content": user.first_talk, "emotion-point": 40}
        assert 2 <= len(spoken) <= 10
        final = spoken[-1]["emotion-point"]
        assert record["emo_point"] == final
        if len(spoken) < 10:  # ended early: only at the benchmark's stops
            assert final >= 100 or final < 10 or re.search(r"(?i)\bbye\b|再见|拜拜", spoken[-1]["content"])
        for before, after in itertools.pairwise(spoken):
            change = after["planning"]["change"]
            assert abs(change) <= 10 and after["emotion-point"] == max(
                0, min(100, before["emotion-point"] + change)
            )

    # the user model saw the opening line and visible replies only, never the policy's system prompt
    plans = [r for r in requests if call_kind(r["messages"]) == "plan"]
    assert plans and all(
        users[0].first_talk in r["messages"][1]["content"]
        or users[1].first_talk in r["messages"][1]["content"]
        for r in plans
    )
    assert not any(BENCHMARK_PROMPT in json.dumps(r) or "<think>" in json.dumps(r) for r in requests)
    transcripts = (root / "rollouts" / "test_step0_rank0.jsonl").read_text().splitlines()
    assert all(json.loads(line)["system_prompt"] == BENCHMARK_PROMPT for line in transcripts)

    from rlver.cli import main  # `rlver score` in this process: it reads files, loads no model

    assert main(["score", str(records_path), "--plot", str(tmp_path / "plot.png")]) == 0
    scored = capsys.readouterr().out
    row = next(line for line in scored.splitlines() if tiny_model_dir.name in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    finals = [r["emo_point"] for r in records]
    assert printed == {
        "Score": round(sum(finals) / len(finals), 1),
        "Success": sum(f >= 100 for f in finals),
        "Failure": sum(f < 10 for f in finals),
    }
    leading = [cell.split()[0] for cell in cells if cell]  # each figure, before its interval
    assert f"{printed['Score']:.1f}" in leading and str(int(printed["Failure"])) in leading
    assert "(95% interval over dialogues)" in result.stdout

    # The judge's dimensions, printed below Failure: the means of the judged file beside the records.
    assert judge_answers.sent == {users[0].first_talk: 2, users[1].first_talk: 3}  # re-asked, bounded
    judged = [json.loads(line) for line in (records_path.parent / f"{records_path.stem}.judged.jsonl").open()]
    assert [row["id"] for row in judged] == [u.id for u in users]
    assert [row["scores"] for row in judged] == [
        {"empathy": 7.0, "insight": 5.0, "action": 4.0},
        {"empathy": None, "insight": 4.0, "action": 9.0},
    ]
    dimensions = numbers(result.stdout, "empathy", "insight", "action", "judge missing")
    for name in ("empathy", "insight", "action"):
        values = [row["scores"][name] for row in judged if row["scores"][name] is not None]
        assert dimensions[name] == round(math.fsum(values) / len(values), 1)
    assert dimensions == {"empathy": 7.0, "insight": 4.5, "action": 6.5, "judge missing": 1}


SAGE_PROTOCOL = REPO.parent / "shared" / "sage-protocol"


@pytest.mark.skipif(not SAGE_PROTOCOL.is_dir(), reason="needs ../shared/sage-protocol (SAGE's code)")
def test_the_leaderboard_recipe_runs_sages_own_code(tmp_path, tiny_model_dir):
    """`rlver test` on recipes/sentient_eval.yaml: SAGE's prompts reach the user model, SAGE's
    system prompt reaches the policy, and the records score as `rlver score` says."""
    recipe = yaml.safe_load((REPO / "recipes" / "sentient_eval.yaml").read_text())
    root = tmp_path / "sentient"
    with ScriptedServer(Script()) as server:
        recipe["trainer"].update(
            accelerator="cpu", precision="32-true", default_root_dir=str(root), limit_test_batches=1
        )
        recipe["trainer"]["logger"]["init_args"]["save_dir"] = str(root)
        model = recipe["model"]
        assert model["simulator"]["name"] == "sage_official" and "system_prompt" not in model["prompt_format"]
        model.update(policy=str(tiny_model_dir), dtype="float32", engine="hf")
        model["simulator"].update(
            code=str(SAGE_PROTOCOL), base_url=server.url, model="scripted-user", api_key_env=None,
            cache=str(tmp_path / "c.sqlite"),
        )  # fmt: skip
        model["rollout"].update(max_turns=3, max_new_tokens=16, max_context_tokens=4096)
        recipe["data"]["batch_size"] = 2
        config = tmp_path / "sentient_official.yaml"
        config.write_text(yaml.safe_dump(recipe, allow_unicode=True))
        result = run_cli("test", "--config", config)
        assert result.returncode == 0, result.stderr[-3000:]
        requests = server.script.requests

    # SAGE's own requests: one user message each, their planning and reply prompts.
    assert requests and all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in requests)
    assert all("emotion分析器" in r["messages"][0]["content"] or "Response:" in r["messages"][0]["content"]
               for r in requests)  # fmt: skip
    transcripts = [
        json.loads(line) for line in (root / "rollouts" / "test_step0_rank0.jsonl").read_text().splitlines()
    ]
    npc = (SAGE_PROTOCOL / "SAGE" / "npc_response.py").read_text(encoding="utf-8")
    assert all(t["system_prompt"] and t["system_prompt"] in npc for t in transcripts)
    records_path = root / "sentient" / f"{tiny_model_dir.name}.jsonl"  # named after the policy
    records = [json.loads(line) for line in records_path.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 2
    for record in records:
        spoken = [m for m in record["history"] if m["role"] == "user"]
        assert spoken[0]["emotion-point"] == 40 and 2 <= len(spoken) <= 10
        for before, after in itertools.pairwise(spoken):  # SAGE's rule: change clamped to +-10, cap 100
            assert after["emotion-point"] == min(
                100, before["emotion-point"] + max(-10, min(10, after["planning"]["change"]))
            )
    printed = numbers(result.stdout, "Score")
    finals = [r["emo_point"] for r in records]
    assert printed["Score"] == round(sum(finals) / len(finals), 1)
