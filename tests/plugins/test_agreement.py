"""The simulator agreement benchmark: recorded SAGE dialogues replayed through a plugin."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rlver.evaluate.agreement import agreement, load_recorded, pearson, ranks, replay, spearman, split_of
from tests.conftest import REPO

SAGE_FILE = REPO.parent / "shared" / "data" / "sage_transcripts_qwen2.5-72b.jsonl"
# Six models' recorded dialogues with GPT-4o playing SAGE's user (the file above: DeepSeek-V3).
GPT4O_USER_FILES = sorted((REPO.parent / "shared" / "data" / "sage-gpt4o-simulator").glob("*.jsonl"))


def held_out_agreement(files, tmp_path, timeout):
    """`tools/simulator_agreement.py` on the held-out split of `files` with the default embedded
    user, as the docs run it; the path of the figures it wrote."""
    out = tmp_path / "agreement.json"
    command = [sys.executable, "tools/simulator_agreement.py", *map(str, files), "--split", "held_out"]
    command += ["--simulator", "{name: embedded, judge: semantic}", "--json", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    return out


def test_correlations_by_hand():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3])) and math.isnan(pearson([1], [2]))
    assert ranks([10, 30, 20, 20]) == [1.0, 4.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [1, 10, 100, 1000]) == pytest.approx(1.0)


def test_the_held_out_split_is_fixed_and_about_thirty_percent():
    ids = [f"dialogue-{i}" for i in range(2000)]
    held = [i for i in ids if split_of(i) == "held_out"]
    assert 0.27 < len(held) / len(ids) < 0.33
    assert held == [i for i in ids if split_of(i) == "held_out"]


def record(dialogue_id="d1", replies=("I hear you, that sounds really hard.", "ok"), changes=(5, -3)):
    history = [{"role": "user", "content": "My boss yelled at me today.", "emotion-point": 40}]
    emotion = 40
    for index, reply in enumerate(replies):
        emotion += changes[index]
        history += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"recorded answer {index}", "emotion-point": emotion},
        ]
    return {
        "id": dialogue_id,
        "emo_point": emotion,
        "player": "* Name: Ann\n* Occupation: clerk",
        "scene": "an office",
        "character": "passive",
        "task": "be understood",
        "history": history,
    }


def test_replay_through_the_embedded_user_follows_the_recording(tmp_path):
    from rlver_plugins.embedded_user import EmbeddedUserSimulator

    path = tmp_path / "model.jsonl"
    path.write_text("\n".join(json.dumps(record(f"d{i}")) for i in range(3)) + "\n")
    dialogues = load_recorded(path)
    assert [d.emotions for d in dialogues] == [[40, 45, 42]] * 3
    assert dialogues[0].replies == ["I hear you, that sounds really hard.", "ok"]
    replays = replay(EmbeddedUserSimulator(language="en"), dialogues)
    for result in replays:
        assert [theirs for _, theirs in result.changes] == [5, -3]
        assert result.final == pytest.approx(40 + sum(ours for ours, _ in result.changes))
    summary = agreement(replays)
    assert summary.turns == 6 and summary.dialogues == 3 and summary.mean_recorded_final == 42


def test_follow_replaces_the_users_latest_message_in_the_sage_session():
    from rlver_plugins.sage_user import SageUserSimulator
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    from rlver.data.profiles import parse_profile

    profile = parse_profile(record(), where="test")
    with ScriptedServer(Script()) as server:
        simulator = SageUserSimulator(base_url=server.url, model="scripted", language="en")
        try:
            session = simulator.open(profile, seed=0)
            session.follow("the recorded opening")
            assert session.opening().text == "the recorded opening"
            session.respond("I understand, that must be hard.")
            session.follow("what the user really said")
            assert session.history[-1] == ("user", "what the user really said")
            assert [who for who, _ in session.history] == ["user", "partner", "user"]
        finally:
            simulator.close()


@pytest.mark.slow
@pytest.mark.skipif(not SAGE_FILE.is_file(), reason="needs ../shared/data (the recorded SAGE dialogues)")
def test_the_benchmark_on_the_recorded_qwen_dialogues(tmp_path):
    out = held_out_agreement([SAGE_FILE], tmp_path, timeout=600)
    (figures,) = json.loads(out.read_text()).values()
    assert figures["dialogues"] == 31 and figures["turns"] > 150
    assert figures["mean_recorded_final"] == pytest.approx(14.8, abs=0.05)  # SAGE's own scores
    # The semantic judge on dialogues its calibration never saw (2026-12-07, fitted on both
    # sources' tune splits: per-turn r 0.559, final r 0.844; the rubric alone: 0.12, -0.19). A
    # refit or an encoder change that loses this fails here.
    assert figures["turn_pearson"] >= 0.53 and figures["final_pearson"] >= 0.8


@pytest.mark.slow
@pytest.mark.skipif(len(GPT4O_USER_FILES) < 2, reason="needs ../shared/data/sage-gpt4o-simulator")
def test_the_benchmark_on_the_gpt4o_user_dialogues_ranks_the_models_as_sage_does(tmp_path):
    out = held_out_agreement(GPT4O_USER_FILES, tmp_path, timeout=900)
    figures = json.loads(out.read_text())
    pooled = figures.pop("all files")
    assert len(figures) == 6 and pooled["dialogues"] == 186 and pooled["turns"] > 1500
    assert pooled["mean_recorded_final"] == pytest.approx(60.3, abs=0.05)  # SAGE's own scores
    # GPT-4o playing the user, on dialogues the calibration was never fitted on (measured
    # 2026-12-07: per-turn r 0.589, final r 0.904, ranking Spearman 0.771, which is 8 of a
    # possible 70 in squared rank differences; 0.75 fails on any worse ranking).
    assert pooled["turn_pearson"] >= 0.56 and pooled["final_pearson"] >= 0.88
    replayed = [f["mean_final"] for f in figures.values()]
    rank_rho = spearman(replayed, [f["mean_recorded_final"] for f in figures.values()])
    assert rank_rho >= 0.75, rank_rho


@pytest.mark.slow
def test_the_benchmark_drives_the_sage_plugin_against_an_endpoint_and_ranks_files(tmp_path):
    from rlver_plugins.sage_user.scripted_server import Script, ScriptedServer

    kind = tmp_path / "kind.jsonl"
    curt = tmp_path / "curt.jsonl"
    kind.write_text("\n".join(json.dumps(record(f"k{i}")) for i in range(2)) + "\n")
    curt_records = [record(f"c{i}", replies=("no.", "whatever."), changes=(-4, -4)) for i in range(2)]
    curt.write_text("\n".join(json.dumps(r) for r in curt_records) + "\n")
    with ScriptedServer(Script()) as server:
        spec = f"{{name: sage, base_url: '{server.url}', model: scripted, language: en}}"
        result = subprocess.run(
            [sys.executable, "tools/simulator_agreement.py", kind, curt, "--simulator", spec],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert server.script.served["ok"] > 0
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "kind: 2 dialogues, 4 turns" in result.stdout and "curt: 2 dialogues" in result.stdout
    # The scripted user gains with empathy cues and loses without, as the recording says.
    assert "model ranking, Spearman with SAGE's: 1.000 (2 models)" in result.stdout, result.stdout
