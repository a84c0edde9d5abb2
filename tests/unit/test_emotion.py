import pytest

from rlver.core.emotion import DIFFICULTIES, Difficulty, apply_change, band, resolve_difficulty, termination


@pytest.mark.parametrize(
    ("emotion", "label"),
    [(100, "S"), (99.9, "A"), (70, "A"), (69, "B"), (40, "B"), (39, "C"), (10, "C"), (9.9, "F"), (0, "F")],
)
def test_band_boundaries(emotion, label):
    assert band(emotion) == label


def test_change_is_clamped_to_ten_and_capped_at_100():
    normal = DIFFICULTIES["normal"]
    assert apply_change(40, 25, normal) == (50, 10)
    assert apply_change(40, -25, normal) == (30, -10)
    assert apply_change(95, 8, normal) == (100, 5)
    assert apply_change(4, -8, normal) == (0, -4)
    assert apply_change(40, 3, normal) == (43, 3)


def test_difficulty_scales_before_the_clamp():
    hard = DIFFICULTIES["hard"]  # gains x0.8, losses x1.25, and (like the reference hard user) no clamp
    assert apply_change(30, 5, hard) == (34, 4)
    assert apply_change(30, -4, hard) == (25, -5)
    assert apply_change(30, -10, hard) == (17.5, -12.5)  # not clamped to -10
    easy = DIFFICULTIES["easy"]  # gains x1.25, clamped to +-10
    assert apply_change(50, 4, easy) == (55, 5)
    assert apply_change(50, 10, easy) == (60, 10)  # 12.5 clamped


def test_unclamped_difficulty_keeps_large_changes():
    reference_hard = Difficulty("ref-hard", start=30, max_change=None)
    assert apply_change(30, -25, reference_hard) == (5, -25)


def test_termination_thresholds():
    normal = DIFFICULTIES["normal"]
    assert termination(100, normal) == "success"
    assert termination(9.5, normal) == "failure"
    assert termination(10, normal) is None
    assert termination(99, normal) is None


def test_resolve_difficulty_presets_and_overrides():
    assert resolve_difficulty("normal").start == 40
    assert resolve_difficulty("hard").start == 30
    custom = resolve_difficulty({"base": "hard", "start": 35})
    assert (custom.start, custom.negative_scale) == (35, 1.25)
    with pytest.raises(ValueError, match="unknown difficulty 'brutal'; available: easy, normal, hard"):
        resolve_difficulty("brutal")
    with pytest.raises(ValueError, match="unknown difficulty option"):
        resolve_difficulty({"base": "easy", "speed": 3})
    with pytest.raises(ValueError, match=r"start \(140\.0\) must be within"):
        Difficulty("x", start=140.0)
