"""How reports and benchmark sections name the machine they ran on."""

from __future__ import annotations

from pathlib import Path

from load_tests.report import cpu_name

ZEN5_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
"""


def test_a_cpu_is_named_with_its_family_and_model(tmp_path: Path) -> None:
    """A VM's model name alone names no generation: the family and model numbers follow it."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(ZEN5_VM)
    assert cpu_name(cpuinfo) == "AMD EPYC family 26 model 2"
    cpuinfo.write_text("model name\t: Neoverse-V2\n")  # arm64's file numbers no family
    assert cpu_name(cpuinfo) == "Neoverse-V2"
    assert cpu_name(tmp_path / "missing")  # the platform's own name, never empty
