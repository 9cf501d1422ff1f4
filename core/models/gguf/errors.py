"""The errors of GGUF reading: a bad file (`GGUFError`), and a gguf package that
cannot be imported (`gguf_import_error`), which is never reported as a bad file."""

from __future__ import annotations

_PIP_NAMES = {"yaml": "pyyaml"}  # import name -> distribution name, where they differ


class GGUFError(ValueError):
    """A GGUF file this loader cannot read: corrupt, truncated, or unsupported."""


def gguf_import_error(exc: ImportError) -> ImportError:
    """The error for an import failure inside (or of) the gguf package: it names
    the missing module, the installed gguf version and the pip command."""
    from importlib import metadata

    missing = exc.name or str(exc)
    try:
        version = metadata.version("gguf")
    except metadata.PackageNotFoundError:
        version = None
    if version is None or missing == "gguf":
        msg = f"reading GGUF files needs the gguf package, which is not installed: pip install gguf ({exc})"
    else:
        msg = (f"the gguf package (version {version}) needs {missing}, which cannot be imported: "
               f"pip install {_PIP_NAMES.get(missing.split('.')[0], missing.split('.')[0])} "
               f"(or a newer gguf: pip install -U gguf) ({exc})")
    err = ImportError(msg, name=missing)
    err.__cause__ = exc
    return err
