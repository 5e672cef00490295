"""What names a CPU (pagedllm.cpu.cpuinfo): two generations behind one generic model name
get different names, so a timing table cached for one is never read on the other."""

from __future__ import annotations

import pytest

from pagedllm.cpu import cpuinfo, kernel_choice

ZEN4 = {"model name": "AMD EPYC", "cpu family": "25", "model": "17", "stepping": "1"}
ZEN5 = {"model name": "AMD EPYC", "cpu family": "26", "model": "2", "stepping": "1"}


def test_model_name_carries_family_model_and_stepping(monkeypatch):
    monkeypatch.setattr(cpuinfo, "cpuinfo_fields", lambda: ZEN5)
    assert cpuinfo.cpu_model() == "AMD EPYC (family 26, model 2, stepping 1)"


def test_two_generations_under_one_name_key_different_timing_tables(monkeypatch):
    paths = []
    for fields in (ZEN4, ZEN5):
        monkeypatch.setattr(cpuinfo, "cpuinfo_fields", lambda fields=fields: fields)
        paths.append(kernel_choice.cache_path(kernel_choice.machine_key()))
    assert paths[0] != paths[1]


@pytest.mark.parametrize("missing", ["cpu family", "model", "stepping"])
def test_name_alone_where_a_number_is_missing(monkeypatch, missing):
    fields = {name: value for name, value in ZEN5.items() if name != missing}
    monkeypatch.setattr(cpuinfo, "cpuinfo_fields", lambda: fields)
    assert cpuinfo.cpu_model() == "AMD EPYC"
