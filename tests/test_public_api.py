import importlib

import rollopt


def test_all_names_exist_and_nothing_else_is_promised():
    assert sorted(rollopt.__all__) == sorted(set(rollopt.__all__))
    for name in rollopt.__all__:
        assert hasattr(rollopt, name), name
    public = {n for n in dir(rollopt) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(rollopt, n)).__name__ == "module"}
    assert public - modules - set(rollopt.__all__) == set()


def test_installed_subpackages_import():
    for name in ("rollopt.environments", "rollopt.schedulers", "rollopt.trainer", "rollopt.testing",
                 "rollopt.engines.local"):
        assert importlib.import_module(name)
