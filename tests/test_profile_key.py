"""The profile key's code digest follows what the calibration code does, not its text."""

from __future__ import annotations

import ast

import pytest

from isagi.profile import DIGESTED_MODULES, code_behaviour, code_digest, module_sources


def _edited(source: str, old: str, new: str) -> str:
    assert source.count(old) >= 1, old
    return source.replace(old, new, 1)


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    found = module_sources()
    assert set(found) == set(DIGESTED_MODULES)
    return found


def test_the_digest_of_the_installed_modules_is_the_default(sources):
    assert code_digest() == code_digest(sources)


@pytest.mark.parametrize("module", DIGESTED_MODULES)
def test_a_changed_docstring_or_comment_leaves_the_digest(sources, module):
    src = sources[module]
    tree = ast.parse(src)
    doc = ast.get_docstring(tree, clean=False)
    assert doc, f"{module} has a module docstring to edit"
    edited = _edited(src, doc, doc + "\n\nA sentence added to the docstring.")
    # a comment on a line of its own and one after code, and a function's docstring rewritten
    edited = _edited(edited, "\nimport ", "\n# a new comment\nimport ")
    edited = _edited(edited, "from __future__ import annotations\n", "from __future__ import annotations  # trailing\n")
    func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and ast.get_docstring(n, clean=False)), None)
    if func is not None:
        fdoc = ast.get_docstring(func, clean=False)
        edited = _edited(edited, fdoc, "Reworded.")
    assert edited != src
    assert code_digest({**sources, module: edited}) == code_digest(sources)


@pytest.mark.parametrize("module", DIGESTED_MODULES)
def test_changed_code_changes_the_digest(sources, module):
    src = sources[module]
    # one statement more at the end of the module: the code now does something else
    assert code_digest({**sources, module: src + "\n_EXTRA = 1\n"}) != code_digest(sources)


def test_a_changed_constant_or_operator_changes_the_behaviour():
    base = "def f(x):\n    '''Doc.'''\n    return x * 2\n"
    assert code_behaviour(base) == code_behaviour("def f(x):  # comment\n    return x * 2  # twice\n")
    assert code_behaviour(base) != code_behaviour(base.replace("2", "3"))
    assert code_behaviour(base) != code_behaviour(base.replace("*", "+"))
    assert code_behaviour(base) != code_behaviour(base.replace("x", "y"))


def test_a_bare_string_that_is_not_a_docstring_is_ignored_but_a_used_string_is_not():
    base = "A = 1\n\"\"\"What A is.\"\"\"\nB = 'text'\n"
    assert code_behaviour(base) == code_behaviour("A = 1\nB = 'text'\n")
    assert code_behaviour(base) != code_behaviour(base.replace("'text'", "'other'"))


def test_the_rekey_script_renames_a_profile_to_todays_key_and_changes_nothing_else(tmp_path):
    """scripts/rekey_profiles.py: a shipped profile keyed under other code gets today's key, its
    profile.json says so, and its arrays and every other field are the same bytes and values."""
    import importlib.util
    import json
    import shutil
    from pathlib import Path

    from isagi.profile import shipped_profiles_dir

    script = Path(__file__).resolve().parent.parent / "scripts" / "rekey_profiles.py"
    spec = importlib.util.spec_from_file_location("rekey_profiles", script)
    rekey_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rekey_mod)

    shipped = sorted(p for p in shipped_profiles_dir().iterdir() if (p / "profile.json").is_file())
    assert shipped
    old_code = "0" * 16  # the digest of some other code
    renamed = {}
    for src in shipped:
        meta = json.loads((src / "profile.json").read_text())
        (backend,) = [b for b in rekey_mod.SHIPPED_QUANTS if rekey_mod.key_of(meta, b, code_digest()) == src.name]
        old_key = rekey_mod.key_of(meta, backend, old_code)
        shutil.copytree(src, tmp_path / old_key)
        (tmp_path / old_key / "profile.json").write_text(json.dumps({**meta, "key": old_key}, indent=1))
        renamed[old_key] = src
    (tmp_path / "not-a-profile").mkdir()
    (tmp_path / "not-a-profile" / "profile.json").write_text(json.dumps(json.loads((shipped[0] / "profile.json").read_text())))

    assert rekey_mod.rekey(tmp_path, old_code, code_digest()) == 1  # the stranger is left alone, and said so
    for old_key, src in renamed.items():
        assert not (tmp_path / old_key).exists()
        got = tmp_path / src.name
        assert (got / "profile.json").read_text() == (src / "profile.json").read_text()
        assert (got / "arrays.npz").read_bytes() == (src / "arrays.npz").read_bytes()
    assert (tmp_path / "not-a-profile").exists()


def test_an_f_strings_literal_parts_count_as_one_whatever_the_python_splits_them_into():
    # Python 3.12 and later split an f-string's literal text and pad a format spec with an
    # empty part where 3.11 does not: the same code must give the same digest on each.
    from isagi.profile import _joined

    parts = [ast.Constant("a"), ast.Constant(""), ast.Constant("b"), ast.FormattedValue(ast.Name("x"), -1, None),
             ast.Constant("")]
    got = _joined(parts)
    assert [type(p).__name__ for p in got] == ["Constant", "FormattedValue"] and got[0].value == "ab"
    assert code_behaviour('s = f"{x:>{w}}" "tail"') == code_behaviour('s = f"{x:>{w}}tail"')


def test_moving_a_module_keeps_the_digest():
    """Where a module lives is not what it does: a digested module that imports a moved module
    by its old name or its new one, in either order (the import sorter reorders on a move),
    has one digest; a real change of what is imported still changes it."""
    src = "from isagi.console.progress import counter\nfrom isagi.data import load_jsonl\n\nX = counter\n"
    assert code_behaviour(src) == code_behaviour(
        "from isagi.data import load_jsonl\nfrom isagi.progress import counter\n\nX = counter\n")
    assert code_behaviour(src) != code_behaviour(src.replace("counter\nfrom", "other\nfrom").replace("X = counter", "X = other"))
    assert code_behaviour(src) != code_behaviour(src.replace("isagi.data", "isagi.elsewhere"))


def test_every_digest_name_row_maps_a_module_of_today_to_a_name_no_module_has():
    """A row of DIGEST_NAMES whose module was renamed again, or whose old name is a module once
    more, would key two different codes alike: each row must be a real move."""
    import importlib.util

    from isagi.profile import DIGEST_NAMES

    for module, old in DIGEST_NAMES.items():
        assert importlib.util.find_spec(module) is not None, module
        assert importlib.util.find_spec(old) is None, old
