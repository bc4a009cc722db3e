"""scripts/mutations.py stays current: each mutation's target text is in its product file exactly
once (a target the code moved away from would leave the mutation unable to apply), and the
tests it names exist."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _mutations():
    spec = importlib.util.spec_from_file_location("mutations", ROOT / "scripts" / "mutations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MUTATIONS


def test_every_mutation_applies_to_its_file_and_names_existing_tests():
    mutations = _mutations()
    assert len({m.name for m in mutations}) == len(mutations), "two mutations share a name"
    for m in mutations:
        found = (ROOT / m.path).read_text().count(m.old)
        assert found == 1, f"{m.name}: its target is in {m.path} {found} times, not once"
        assert m.old != m.new, m.name
        for arg in m.tests:
            if arg.startswith("tests/"):
                assert (ROOT / arg.split("::")[0]).is_file(), f"{m.name}: no {arg}"
