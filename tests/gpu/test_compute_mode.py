"""Reading the GPU's compute mode: nvidia-smi output as captured from real drivers, driver values."""

from __future__ import annotations

import pytest

from pdkv.gpu.compute_mode import mode_name, parse_nvidia_smi, problem


def test_nvidia_smi_lines_are_read_per_gpu():
    text = "0, Default\n1, Exclusive_Process\n2, Prohibited\n\n"
    assert parse_nvidia_smi(text) == {0: "Default", 1: "Exclusive_Process", 2: "Prohibited"}


def test_older_spellings_and_case_are_normalised():
    assert parse_nvidia_smi("0, E. Process\n1, DEFAULT\n3, e. thread") == {
        0: "Exclusive_Process", 1: "Default", 3: "Exclusive_Thread"}


def test_unreadable_output_is_an_error_naming_the_line():
    with pytest.raises(ValueError, match="cannot read the line 'No devices were found'"):
        parse_nvidia_smi("No devices were found\n")


def test_driver_values_have_the_same_names():
    assert [mode_name(v) for v in (0, 2, 3)] == ["Default", "Prohibited", "Exclusive_Process"]
    assert mode_name(9) == "unknown (9)"


def test_only_default_lets_two_processes_share_the_gpu():
    assert problem("Default") is None
    msg = problem("Exclusive_Process")
    assert "compute mode is Exclusive_Process" in msg and "nvidia-smi -i <gpu> -c DEFAULT" in msg
    assert problem("Prohibited") is not None
