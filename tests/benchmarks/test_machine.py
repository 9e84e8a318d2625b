"""benchmarks/machine.py, the one description of the machine that every benchmark's report and header carry:
read from a /proc/cpuinfo of the machines the benchmarks ran on, and from none."""

from __future__ import annotations

import pytest

from benchmarks import machine

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse4_1 sse4_2 fma avx f16c avx2 avx512f avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: another CPU
"""
ZEN4 = """processor\t: 0
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu avx2 fma avx512f avx512bw avx512_vnni avx512_bf16
"""
ZEN3 = """processor\t: 0
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu avx2 fma
"""


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    def write(text: str | None):
        path = tmp_path / "cpuinfo"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(machine, "CPUINFO", path)
    return write


def test_the_first_processor_gives_name_numbers_features_and_flags(cpuinfo):
    cpuinfo(XEON)
    info = machine.machine_info(threads=1)
    assert info["cpu_model"] == "Intel(R) Xeon(R) Processor"
    assert (info["cpu_family"], info["cpu_model_number"]) == (6, 167)
    assert info["cpu_features"] == {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_tile": True}
    assert info["cpu_flags"] == ["amx_bf16", "amx_int8", "amx_tile", "avx", "avx2", "avx512_bf16", "avx512f",
                                 "avx_vnni", "f16c", "fma", "sse4_1", "sse4_2"]
    assert info["threads"] == 1 and info["cpu_count"] >= 1 and info["torch"] and info["python"]
    assert machine.machine_line(info) == (f"Intel Xeon (family 6 model 167; AVX-512 BF16, AMX), "
                                          f"{info['cpu_count']} cores, 1 thread")


@pytest.mark.parametrize("text,line", [(ZEN4, "AMD EPYC 9R14 96-Core (family 25 model 17; AVX-512 BF16)"),
                                       (ZEN3, "AMD EPYC 7R13 (family 25 model 1; AVX2)")])
def test_a_header_names_the_top_of_the_vector_ladder_and_amx_only_where_present(cpuinfo, text, line):
    cpuinfo(text)
    info = machine.machine_info(threads=2)
    assert not info["cpu_features"]["amx_tile"]
    assert machine.machine_line(info) == f"{line}, {info['cpu_count']} cores, 2 threads"


def test_without_a_cpuinfo_the_cpu_is_named_by_platform_and_has_no_features(cpuinfo, monkeypatch):
    cpuinfo(None)
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    info = machine.machine_info(threads=3)
    assert info["cpu_model"] == "unknown CPU" and info["cpu_family"] is info["cpu_model_number"] is None
    assert not any(info["cpu_features"].values()) and info["cpu_flags"] == []
    assert machine.machine_line(info) == f"unknown CPU (no AVX2), {info['cpu_count']} cores, 3 threads"


def test_threads_default_to_torchs_own():
    import torch

    assert machine.machine_info()["threads"] == torch.get_num_threads()
