"""pagefleet.operator: InferenceService spec, renderers, autoscaling policy, kopf handlers, CLI."""

if __name__ == "operator":
    # This folder is the import package `pagefleet.operator`, but when the repo
    # root is on sys.path (`python -m ...` or `python -c` run from a checkout)
    # Python finds it first as the stdlib's `operator`. Step aside: load the real
    # stdlib module and replace ourselves with it (import machinery returns
    # whatever sys.modules holds after a module's body runs).
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _saved = _sys.path[:]
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _root]
    del _sys.modules["operator"]
    try:
        import operator as _stdlib_operator
    finally:
        _sys.path[:] = _saved
    _sys.modules["operator"] = _stdlib_operator
