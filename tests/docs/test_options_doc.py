"""The option tables of docs/reference/options.md are the parsers' own (tools/docgen.py), and
every ``COLLECTIVE_*`` variable the code reads is named somewhere in the docs."""

from __future__ import annotations

import re

from tests.docs.blocks import ROOT, pages
from tools import docgen


def test_options_reference_is_generated_from_the_code():
    committed = docgen.OUT.read_text() if docgen.OUT.exists() else ""
    assert committed == docgen.generate(), (
        "docs/reference/options.md differs from the flags in the code: run `python -m tools.docgen` and commit it")


def test_every_environment_variable_the_code_reads_is_documented():
    code = "".join(p.read_text() for d in ("collective", "tools") for p in (ROOT / d).rglob("*.py")
                   if "_proto" not in p.parts)
    read = set(re.findall(r"COLLECTIVE_[A-Z0-9_]*[A-Z0-9]", code)) - {"COLLECTIVE_NAME"}  # NAME: a docstring's placeholder
    docs = "".join(p.read_text() for p in pages())
    missing = sorted(v for v in read if v not in docs)
    assert not missing, f"read by the code but named in no page of the docs: {missing}"
