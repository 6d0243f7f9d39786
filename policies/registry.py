"""Finding a policy by name: built-ins, `module:Class`, `path/to/file.py:Class`, or the
`kvgate.policies` entry-point group, so third parties can ship policies without forking."""

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path

from policies.api import Policy
from policies.kv_cost import KvCost
from policies.least_load import LeastLoad
from policies.prefix_affinity import PrefixAffinity
from policies.round_robin import RoundRobin
from policies.slo_goodput import SloGoodput

ENTRY_POINT_GROUP = "kvgate.policies"
_BUILTINS = {cls.name: cls for cls in (RoundRobin, LeastLoad, PrefixAffinity, KvCost, SloGoodput)}
BUILTIN_POLICIES = tuple(_BUILTINS)


def load_policy(spec: str, **kwargs) -> Policy:
    """Build the policy `spec` names, passing `kwargs` to its constructor."""
    if spec in _BUILTINS:
        factory = _BUILTINS[spec]
    elif ":" in spec:
        factory = _load_attr(*spec.rsplit(":", 1))
    else:
        factory = _entry_point(spec)
    policy = factory(**kwargs)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy {spec!r} has no `name` attribute and `route(req, fleet)` method")
    return policy


def _load_attr(module: str, attr: str):
    """`attr` of a module given by dotted name or by a .py file path."""
    if module.endswith(".py") or "/" in module or "\\" in module:
        mod = _import_file(Path(module))
    else:
        mod = importlib.import_module(module)
    if not hasattr(mod, attr):
        raise ValueError(f"policy plugin {module!r} has no attribute {attr!r}")
    return getattr(mod, attr)


def _import_file(path: Path):
    """Import a plugin file that is not part of an installed package. It is registered in
    `sys.modules` (under a name derived from its resolved path) so that dataclasses and pickling
    inside it work, and so loading it twice yields the same classes."""
    if not path.is_file():
        raise ValueError(f"policy plugin file {str(path)!r} does not exist")
    name = "kvgate_plugin_" + "_".join(path.resolve().with_suffix("").parts[1:])
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"policy plugin file {str(path)!r} is not a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def _entry_point(name: str):
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    raise ValueError(
        f"unknown policy {name!r}: built-ins are {', '.join(BUILTIN_POLICIES)}; "
        f"or give 'module:Class', 'path/to/plugin.py:Class', or install a package "
        f"with a {ENTRY_POINT_GROUP!r} entry point"
    )
