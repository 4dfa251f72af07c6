"""tests/mutations.py stays applicable to the code as it is: each mutation's text occurs once in its
file, and each test it names exists. Running the mutations takes minutes (not a test); a mutation
whose text the code no longer holds would stop that script at its turn, after the others ran."""

from __future__ import annotations

import re

from mutations import MUTATIONS

from conftest import ROOT


def test_every_mutation_applies_once_and_names_tests_that_exist() -> None:
    assert len(MUTATIONS) >= 20
    for m in MUTATIONS:
        text = (ROOT / m.file).read_text(encoding="utf-8")
        assert text.count(m.old) == 1, (m.name, m.file, text.count(m.old))
        assert m.new != m.old, m.name
        for test in m.tests:
            file, _, name = test.partition("::")
            source = (ROOT / file).read_text(encoding="utf-8")
            name = name.split("[", 1)[0]
            assert not name or re.search(rf"^def {re.escape(name)}\(", source, re.M), (m.name, test)
