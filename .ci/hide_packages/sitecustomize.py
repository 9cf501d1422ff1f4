"""Make installed packages look NOT installed, for checking that optional
dependencies are optional (`make test` runs the conformance suite this way).

    HIDE_PACKAGES=xgrammar,triton PYTHONPATH=.ci/hide_packages python ...

Python imports `sitecustomize` at start-up, so every interpreter started with
this PYTHONPATH (spawned child processes included) hides, for each name in
HIDE_PACKAGES, the top-level module and its submodules from the import system
(`import x` raises ModuleNotFoundError "No module named 'x'", and
`importlib.util.find_spec("x")` returns None, as for a package that was never
installed) and the distribution of that name from `importlib.metadata`.
It wraps the finders on `sys.meta_path` at start-up; a finder added later is
not wrapped.
"""

import os
import re
import sys

_HIDDEN = {n.strip() for n in os.environ.get("HIDE_PACKAGES", "").split(",") if n.strip()}


def _dist_key(name):
    return re.sub(r"[-_.]+", "-", name).lower()


_HIDDEN_DISTS = {_dist_key(n) for n in _HIDDEN}


def _hidden(fullname):
    return fullname.partition(".")[0] in _HIDDEN


class _HidingFinder:
    """Delegates to `finder`, except that hidden modules and distributions are not found."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, fullname, path=None, target=None):
        if _hidden(fullname) or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(fullname, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self._finder, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(*args, **kwargs)
                if _dist_key(d.metadata["Name"] or "") not in _HIDDEN_DISTS)

    def invalidate_caches(self):
        if hasattr(self._finder, "invalidate_caches"):
            self._finder.invalidate_caches()

    def __getattr__(self, name):
        return getattr(self._finder, name)

    def __repr__(self):
        return f"<hiding {sorted(_HIDDEN)} from {self._finder!r}>"


if _HIDDEN:
    for _name in list(sys.modules):
        if _hidden(_name):
            del sys.modules[_name]
    sys.meta_path[:] = [_HidingFinder(f) for f in sys.meta_path]
