"""The flag table of docs/USAGE.md is the one ``python -m mechmon_megatron.cli.flag_table`` generates
from the ``MechmonConfig`` fields: a field added, renamed or given another default or help fails here
until the table is regenerated (``--write``)."""

from __future__ import annotations

import argparse

from mechmon_megatron.cli.args import add_mechmon_args
from mechmon_megatron.cli.flag_table import BEGIN, END, USAGE, flag_table, main, replace_table
from mechmon_megatron.session.config import OPTIONS, flag_of


def test_the_table_in_usage_md_is_the_generated_one():
    text = USAGE.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    in_docs = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert in_docs == flag_table(), (
        "docs/USAGE.md's flag table differs from the fields: run `python -m mechmon_megatron.cli.flag_table --write`")


def test_one_row_per_setting_naming_its_flag_and_key():
    rows = flag_table().splitlines()[2:]
    assert len(rows) == len(OPTIONS)
    parser = add_mechmon_args(argparse.ArgumentParser())
    for row, name in zip(rows, OPTIONS):
        flag = flag_of(name)
        assert row.startswith(f"| `{flag}") and f"| `{name}` |" in row, row
        assert flag in parser._option_string_actions  # noqa: SLF001 -- the flag the row names exists


def test_replace_and_print(capsys):
    assert replace_table(f"a\n{BEGIN}\nold\n{END}\nb\n", "new\n") == f"a\n{BEGIN}\nnew\n{END}\nb\n"
    assert main([]) == 0
    assert capsys.readouterr().out == flag_table()
