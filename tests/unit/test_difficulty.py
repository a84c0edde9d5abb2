"""Environment difficulty: presets, per-profile levels, the curriculum and its wiring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from rlver_plugins.embedded_user import EmbeddedUserSimulator
from rlver_plugins.formats import NoThinkFormat
from rlver_plugins.hf_engine import HFEngine

from rlver.cli import parse_recipe
from rlver.core.emotion import DIFFICULTIES, apply_change, profile_difficulty, resolve_difficulty, termination
from rlver.core.interfaces import RolloutEngine
from rlver.core.plugins import plain_config
from rlver.core.types import Profile
from rlver.data.profiles import ProfileError, load_profiles
from rlver.rollout.runner import RolloutRunner, RolloutSettings
from rlver.train.curriculum import DifficultyCurriculum, difficulty_metrics
from rlver.train.module import RLVERModule
from rlver.train.run_log import rank_difficulty_metrics
from tests.conftest import REPO

HOSTILE = "Shut up, you're pathetic, nobody cares."  # raw change well below -10 for this profile


def make_profile(pid: str = "maya", difficulty=None) -> Profile:
    extra = {"lang": "en", "theme": "deep_empathy"}
    if difficulty is not None:
        extra["difficulty"] = difficulty
    return Profile(
        id=pid,
        player="Name: Maya\nAge: 34\nJob: nurse",
        scene="Tom, the brother of Maya, skipped Mum's birthday dinner and then said the cake was dry.",
        main_cha="negative",
        cha_group=("quiet", "polite", "anxious"),
        task="You want deep empathy for what you feel, not shallow comfort.",
        first_talk="My brother skipped Mum's party that I organised, and then he complained about it.",
        extra=extra,
    )


# ---------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize(
    ("name", "start", "max_change", "failure_below", "failure_at_or_below"),
    [
        ("easy", 50.0, 10.0, 10.0, None),
        ("normal", 40.0, 10.0, 10.0, None),  # SAGE / the benchmark
        ("hard", 30.0, None, None, 0.0),  # the reference hard training user
    ],
)
def test_preset_numbers(name, start, max_change, failure_below, failure_at_or_below):
    level = DIFFICULTIES[name]
    assert (level.name, level.start, level.max_change) == (name, start, max_change)
    assert (level.failure_below, level.failure_at_or_below, level.success_at) == (
        failure_below,
        failure_at_or_below,
        100.0,
    )


def test_normal_keeps_the_benchmark_end_conditions():
    normal = DIFFICULTIES["normal"]
    assert [termination(e, normal) for e in (100, 99.9, 10, 9.99, 0)] == [
        "success",
        None,
        None,
        "failure",
        "failure",
    ]


def test_hard_is_unclamped_and_ends_only_when_emotion_reaches_zero():
    hard = DIFFICULTIES["hard"]
    assert apply_change(30, -20, hard) == (5.0, -25.0)  # -20 x 1.25, no clamp
    assert apply_change(30, 20, hard) == (46.0, 16.0)  # +20 x 0.8, no clamp
    assert apply_change(10, -20, hard) == (0.0, -10.0)  # still capped at 0
    assert [termination(e, hard) for e in (100, 5, 0.01, 0)] == ["success", None, None, "failure"]


def test_profile_difficulty_wins_over_the_default():
    normal = DIFFICULTIES["normal"]
    assert profile_difficulty(make_profile(), normal) is normal
    assert profile_difficulty(make_profile(difficulty="hard"), normal) is DIFFICULTIES["hard"]
    assert profile_difficulty(make_profile(difficulty={"base": "easy", "start": 60}), normal).start == 60
    with pytest.raises(ValueError, match="maya: difficulty: unknown difficulty 'brutal'"):
        profile_difficulty(make_profile(difficulty="brutal"), normal)


# ------------------------------------------------------------------------- the embedded user obeys
def test_a_profile_level_beats_the_embedded_simulator_option():
    simulator = EmbeddedUserSimulator(difficulty="easy")
    as_option = simulator.open(make_profile(), seed=0)
    as_profile = simulator.open(make_profile(difficulty="hard"), seed=0)
    assert as_option.opening().emotion == 50.0 and as_option.difficulty.name == "easy"
    assert as_profile.opening().emotion == 30.0 and as_profile.difficulty.name == "hard"
    # The rubric's tolerance follows the session's level, not the simulator's.
    assert as_option.rubric.settings.tolerance == 0.8 and as_profile.rubric.settings.tolerance == 0.2
    assert simulator.difficulty.name == "easy"  # the simulator itself is unchanged


def test_clamping_follows_the_profile_level():
    # The rubric's raw changes go past 10 (the semantic judge's stay within SAGE's -10..10).
    clamped = EmbeddedUserSimulator(difficulty="hard", judge="rubric").open(
        make_profile(difficulty="normal"), seed=0
    )
    turn = clamped.respond(HOSTILE)
    assert turn.reason["raw_change"] < -10
    assert turn.change == -10.0 and turn.emotion == 30.0  # normal: 40, clamped to -10

    free = EmbeddedUserSimulator(difficulty="normal", judge="rubric").open(
        make_profile(difficulty="hard"), seed=0
    )
    turn = free.respond(HOSTILE)
    raw = turn.reason["raw_change"]
    assert turn.change == pytest.approx(max(-30.0, raw * 1.25), abs=0.01) and turn.change < -12.5
    assert turn.emotion == pytest.approx(30.0 + turn.change, abs=0.01)


def test_hard_dialogues_end_at_zero_not_below_ten():
    simulator = EmbeddedUserSimulator(difficulty="hard")
    survives = simulator.open(make_profile(difficulty={"base": "hard", "start": 20}), seed=0)
    turn = survives.respond("zxcvb qwrtp")  # garbled: raw -10, x1.25
    assert turn.emotion == 7.5 and turn.reason["band"] == "F" and turn.termination is None
    ends = simulator.open(make_profile(difficulty={"base": "hard", "start": 12}), seed=0)
    turn = ends.respond("zxcvb qwrtp")
    assert turn.emotion == 0.0 and turn.termination == "failure"


def test_a_bad_profile_difficulty_names_file_and_line(tmp_path):
    good = make_profile("a").to_record()
    bad = {**make_profile("b").to_record(), "difficulty": "brutal"}
    path = tmp_path / "profiles.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ProfileError, match=rf"{path}:2: field 'difficulty': unknown difficulty 'brutal'"):
        load_profiles(path)
    path.write_text(json.dumps({**good, "difficulty": {"base": "hard", "start": 140}}) + "\n")
    with pytest.raises(ProfileError, match=rf"{path}:1: field 'difficulty': .*start \(140\)"):
        load_profiles(path)
    path.write_text(json.dumps({**good, "difficulty": "hard"}) + "\n")
    assert load_profiles(path)[0].extra["difficulty"] == "hard"


@pytest.mark.slow
def test_transcripts_record_the_level_played(policy):
    runner = RolloutRunner(
        policy,
        HFEngine(policy),
        EmbeddedUserSimulator(difficulty="easy"),
        NoThinkFormat(),
        RolloutSettings(max_turns=1, max_new_tokens=4, temperature=1.0, seed=1),
    )
    by_option, by_profile = runner.run([make_profile("a"), make_profile("b", difficulty="hard")])
    assert (by_option.difficulty, by_option.start_emotion) == ("easy", 50.0)
    assert (by_profile.difficulty, by_profile.start_emotion) == ("hard", 30.0)
    assert by_profile.to_record()["difficulty"] == "hard"


# ------------------------------------------------------------------------------------ curriculum
STAGES = [
    {"until_step": 3, "mix": "easy"},
    {"until_step": 6, "mix": {"easy": 1, "normal": 3}},
    {"mix": {"normal": 1, "hard": 1, "easy": 0}},
]


def test_stage_boundaries():
    curriculum = DifficultyCurriculum.from_config(STAGES)
    assert [curriculum.stage_at(step) for step in (0, 2)] == [curriculum.stages[0]] * 2
    assert [curriculum.stage_at(step) for step in (3, 5)] == [curriculum.stages[1]] * 2
    assert [curriculum.stage_at(step) for step in (6, 10_000)] == [curriculum.stages[2]] * 2
    assert {curriculum.level_for(2, f"p{i}", i, 0) for i in range(200)} == {"easy"}
    assert {curriculum.level_for(6, f"p{i}", i, 0) for i in range(200)} == {"normal", "hard"}  # easy: 0
    assert curriculum.levels == ["easy", "normal", "hard"]
    # Past the last until_step, the last stage holds.
    capped = DifficultyCurriculum.from_config(
        [{"until_step": 2, "mix": "easy"}, {"until_step": 4, "mix": "hard"}]
    )
    assert [capped.level_for(step, "p", 0, 0) for step in (1, 2, 3, 4, 99)] == [
        "easy",
        "hard",
        "hard",
        "hard",
        "hard",
    ]
    assert DifficultyCurriculum.from_config("hard").level_for(123, "p", 0, 0) == "hard"


def test_mix_proportions_over_many_profiles():
    curriculum = DifficultyCurriculum.from_config(STAGES)
    levels = [curriculum.level_for(4, f"profile-{i}", i, seed=7) for i in range(4000)]
    assert set(levels) == {"easy", "normal"}
    assert levels.count("normal") / len(levels) == pytest.approx(0.75, abs=0.03)
    # Different steps and seeds draw afresh.
    again = [curriculum.level_for(5, f"profile-{i}", i, seed=7) for i in range(4000)]
    assert again != levels


def test_levels_are_deterministic_across_processes():
    curriculum = DifficultyCurriculum.from_config(STAGES)
    here = [curriculum.level_for(7, f"p{i}", i, 3) for i in range(40)]
    assert here == [curriculum.level_for(7, f"p{i}", i, 3) for i in range(40)]
    code = (
        "from rlver.train.curriculum import DifficultyCurriculum as C\n"
        f"c = C.from_config({STAGES!r})\n"
        "print(','.join(c.level_for(7, f'p{i}', i, 3) for i in range(40)))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert other.stdout.strip().split(",") == here


def test_assign_sets_the_level_without_touching_the_batch():
    curriculum = DifficultyCurriculum.from_config(STAGES)
    batch = [make_profile(f"p{i}") for i in range(6)]
    assigned = curriculum.assign(batch, step=4, seed=1, offset=10)
    assert [p.id for p in assigned] == [p.id for p in batch]
    assert [p.extra["difficulty"] for p in assigned] == [
        curriculum.level_for(4, f"p{i}", 10 + i, 1) for i in range(6)
    ]
    assert all("difficulty" not in p.extra for p in batch)
    assert all(p.extra["theme"] == "deep_empathy" for p in assigned)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([], "--model.curriculum must be a level name or a non-empty list of stages"),
        ({"mix": "easy"}, "--model.curriculum must be a level name or a non-empty list"),
        ("brutal", r"--model.curriculum\[0\].mix: unknown level 'brutal'; available: easy, normal, hard"),
        (["easy"], r"--model.curriculum\[0\] must be a mapping with until_step and mix"),
        ([{"until": 3, "mix": "easy"}], r"--model.curriculum\[0\]: unknown key\(s\) until"),
        ([{"mix": "easy"}, {"mix": "hard"}], r"--model.curriculum\[0\].until_step is required"),
        (
            [{"until_step": 0, "mix": "easy"}, {"mix": "hard"}],
            r"\[0\].until_step \(0\) must be an integer > 0",
        ),
        (
            [{"until_step": 5, "mix": "easy"}, {"until_step": 5, "mix": "hard"}],
            r"\[1\].until_step \(5\) must be an integer > the previous stage's \(5\)",
        ),
        ([{"mix": {"easy": -1}}], r"--model.curriculum\[0\].mix.easy \(-1\) must be a number >= 0"),
        ([{"mix": {"easy": 0}}], r"--model.curriculum\[0\].mix: every weight is 0"),
        ([{"mix": {}}], r"--model.curriculum\[0\].mix must be a level name or a non-empty"),
    ],
)
def test_bad_curricula_name_the_flag(config, message):
    with pytest.raises(ValueError, match=message):
        DifficultyCurriculum.from_config(config)


def test_difficulty_metrics_share_and_mean_per_level():
    metrics = difficulty_metrics(
        ["easy", "easy", "hard", None], [60.0, 80.0, 20.0, 50.0], ["easy", "normal", "hard"]
    )
    assert metrics == {
        "rollout/difficulty/easy": 0.5,
        "rollout/difficulty/normal": 0.0,
        "rollout/difficulty/hard": 0.25,
        "rollout/final_emotion/easy": 70.0,
        "rollout/final_emotion/hard": 20.0,
    }

    # Counts are summed over ranks before dividing: a level only another rank drew still gets its mean.
    def two_ranks(values):
        other = [0.0, 0.0, 2.0, 0.0, 0.0, 90.0, 2.0]  # counts (easy, normal, hard), sums, total
        return [a + b for a, b in zip(values, other, strict=True)]

    metrics = difficulty_metrics(["easy", "easy"], [60.0, 80.0], ["easy", "normal", "hard"], two_ranks)
    assert metrics["rollout/difficulty/hard"] == 0.5 and metrics["rollout/final_emotion/hard"] == 45.0
    assert "rollout/final_emotion/normal" not in metrics


# ---------------------------------------------------------------------------- module wiring
class _StopAfterRollout(Exception):
    pass


class _UnusedEngine(RolloutEngine):
    def generate(self, prompts, sampling):
        raise AssertionError("the recording runner never generates")


class _RecordingRunner:
    """Stands in for the RolloutRunner: records the dialogues training_step asks for, then stops."""

    engine = _UnusedEngine()  # released after the rollout, whatever it did

    def run(self, dialogues, seed, **options):  # group_size, should_stop, ...: not needed here
        self.dialogues = list(dialogues)
        raise _StopAfterRollout


def test_training_step_gives_each_group_one_level():
    module = RLVERModule(
        group_size=3, curriculum=[{"until_step": 1, "mix": {"easy": 1, "hard": 1}}, {"mix": "normal"}]
    )
    assert isinstance(module.curriculum, DifficultyCurriculum)
    module.rollouts.runner = _RecordingRunner()
    batch = [make_profile(f"p{i}") for i in range(8)]
    with pytest.raises(_StopAfterRollout):
        module.training_step(batch, 0)  # global_step 0 without a trainer: the mixed stage
    dialogues = module.runner.dialogues
    assert len(dialogues) == 24
    groups = [dialogues[i : i + 3] for i in range(0, 24, 3)]
    for profile, group in zip(batch, groups, strict=True):
        assert {p.id for p in group} == {profile.id}
        assert len({p.extra["difficulty"] for p in group}) == 1  # a GRPO group shares its level
    levels = [group[0].extra["difficulty"] for group in groups]
    seed = module.rollout_settings.seed
    assert levels == [module.curriculum.level_for(0, f"p{i}", i, seed) for i in range(8)]
    assert set(levels) <= {"easy", "hard"}
    assert all("difficulty" not in p.extra for p in batch)

    trajectories = [SimpleNamespace(profile=p, final_emotion=50.0 + i) for i, p in enumerate(dialogues)]
    metrics = rank_difficulty_metrics(trajectories, module.curriculum.levels, module.ranks, module.device)
    assert sum(
        metrics[f"rollout/difficulty/{level}"] for level in ("easy", "normal", "hard")
    ) == pytest.approx(1.0)
    assert metrics["rollout/difficulty/normal"] == 0.0


def test_no_curriculum_leaves_profiles_alone():
    module = RLVERModule(group_size=2)
    assert module.curriculum is None
    module.rollouts.runner = _RecordingRunner()
    batch = [make_profile("p0", difficulty="hard"), make_profile("p1")]
    with pytest.raises(_StopAfterRollout):
        module.training_step(batch, 0)
    assert [p.extra.get("difficulty") for p in module.runner.dialogues] == ["hard", "hard", None, None]


def test_a_bad_curriculum_fails_at_construction_with_the_flag():
    with pytest.raises(ValueError, match=r"--model.curriculum\[0\].mix: unknown level 'expert'"):
        RLVERModule(curriculum=[{"mix": "expert"}])


def test_the_curriculum_recipe_climbs_from_easy_to_hard():
    config = parse_recipe(str(REPO / "recipes" / "curriculum.yaml"))
    curriculum = DifficultyCurriculum.from_config(plain_config(config.model.curriculum))
    steps = config.trainer.max_steps
    drawn = [{curriculum.level_for(step, f"p{i}", i, 0) for i in range(64)} for step in range(steps)]
    assert drawn[0] == {"easy"} and "hard" in drawn[-1]
    assert set().union(*drawn) == {"easy", "normal", "hard"}
    assert config.model.simulator == {"name": "embedded", "difficulty": "normal"}


def test_the_ablation_recipes_differ_only_in_difficulty_and_run_name():
    normal, hard = ((REPO / "recipes" / f"env_{level}.yaml").read_text() for level in ("normal", "hard"))
    body = [line for line in normal.splitlines() if not line.startswith("#")]
    other = [line for line in hard.splitlines() if not line.startswith("#")]
    differing = [(a, b) for a, b in zip(body, other, strict=True) if a != b]
    assert all(a.replace("env_normal", "env_hard") == b for a, b in differing if "env_normal" in a)
    assert [(a.strip(), b.strip()) for a, b in differing if "env_normal" not in a] == [
        ("difficulty: normal", "difficulty: hard")
    ]
    for level in ("normal", "hard"):
        model = parse_recipe(str(REPO / "recipes" / f"env_{level}.yaml")).model
        assert model.simulator["name"] == "sage" and model.simulator["difficulty"] == level
        assert resolve_difficulty(model.simulator["difficulty"]).name == level


def test_evaluation_rollouts_talk_with_another_simulator_then_restore_the_training_one():
    """BeforeAfter's evaluators (issue 56): the runner meets the other simulator's users at the
    evaluation temperature, and the training simulator and settings are back afterwards."""
    module = RLVERModule(eval_temperature=0.0)
    training_simulator, other = module.simulator, SimpleNamespace(name="other")
    seen = []

    class Runner:
        engine = _UnusedEngine()
        settings, simulator = module.rollout_settings, training_simulator

        def run(self, profiles, seed, **options):
            seen.append((self.simulator, self.settings.temperature))
            return []

    module.rollouts.runner = Runner()
    module.evaluation_rollouts([make_profile("p0")], seed=0, simulator=other)
    module.evaluation_rollouts([make_profile("p0")], seed=0)
    assert seen == [(other, 0.0), (training_simulator, 0.0)]
    assert module.runner.simulator is training_simulator and module.runner.settings is module.rollout_settings
