"""`precision: auto` and engine `dtype: auto`: float32 on every CPU, bfloat16 on CUDA devices with it;
`cpu_bf16` still says where a requested bf16 would be native."""

import os
import subprocess
import sys

import pytest

from rlver.modeling.precision import cpu_bf16, resolve_dtype, resolve_precision
from tests.conftest import REPO

AVX512 = {"avx2", "avx512f", "avx512bw", "avx512vl"}


@pytest.mark.parametrize(
    ("capability", "flags", "machine", "env", "native"),
    [
        ("AVX512", AVX512 | {"avx512_bf16"}, "x86_64", {}, True),  # Zen 4, Cooper Lake, Sapphire Rapids
        ("AVX512", AVX512 | {"amx_bf16", "amx_tile"}, "x86_64", {}, True),  # AMX
        ("AVX512", AVX512, "x86_64", {}, False),  # Skylake-X, Ice Lake: AVX-512 but no BF16
        ("AVX2", {"avx2", "fma"}, "x86_64", {}, False),  # most laptops, AMD before Zen 4
        ("AVX2", AVX512 | {"avx512_bf16"}, "x86_64", {}, False),  # ATEN_CPU_CAPABILITY=avx2
        ("AVX512", AVX512 | {"avx512_bf16"}, "x86_64", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
        ("AVX512", AVX512 | {"avx512_bf16"}, "x86_64", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),
        ("DEFAULT", {"fp", "asimd", "bf16"}, "aarch64", {}, True),  # Graviton 3, Apple M2+ under Linux
        ("DEFAULT", {"fp", "asimd"}, "aarch64", {}, False),  # older ARM
    ],
)
def test_each_kind_of_cpu_gets_bf16_only_when_native(capability, flags, machine, env, native):
    choice = cpu_bf16(capability, flags, machine, env)
    assert choice.bf16 is native
    assert choice.reason  # the one line the log shows


def test_explicit_settings_pass_through():
    assert resolve_precision("32-true", "cpu") == ("32-true", None)
    assert resolve_precision("bf16-mixed", "gpu") == ("bf16-mixed", None)
    assert resolve_dtype("float16", "cuda") == ("float16", None)


EMULATION = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def run_resolution(env, drop=()):
    code = (
        "from rlver.modeling.precision import resolve_precision, resolve_dtype;"
        "print(resolve_precision('auto', 'cpu')[0], resolve_dtype('auto', 'cpu')[0])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**{k: v for k, v in os.environ.items() if k not in drop}, **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_auto_is_float32_on_every_cpu_class():
    """Issue 53: bf16's learning depended on the CPU's bf16 kernels, so auto never picks it on a
    CPU, whichever kernels torch and oneDNN may use (the AMX-less class emulated by its flag,
    the AVX2 class by its two, and this machine as it is)."""
    for env in (
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    ):
        assert run_resolution(env) == ["32-true", "float32"]
    assert run_resolution({}, drop=EMULATION) == ["32-true", "float32"]


def test_the_quickstart_recipe_resolves_auto_at_fit_time(tmp_path):
    from rlver.cli import parse_recipe

    config = parse_recipe(str(REPO / "recipes" / "quickstart.yaml"))
    assert config.trainer.precision == "auto"  # resolved when the Trainer is built, not in the file
