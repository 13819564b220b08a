"""keras_ipu's layers registered with Keras' serialization as soon as Keras is imported.

A model saved with keras_ipu's layers must load after `import keras_ipu`, as
with IPU TensorFlow, without importing the layers' modules by hand; but
`import keras_ipu` imports neither Keras nor JAX (it stays light, and picks
Keras' backend first). `install` puts a finder before Python's own: when
Keras is first imported, it runs Keras' own loader, then imports the
registering modules. Keras imported while one of those modules is itself
being imported (`import keras_ipu.keras.layers` before `import keras`)
defers the registration to the end of that module (`complete`), where the
names the others import from it exist.

Example:

```python
import keras_ipu          # installs the finder
import keras              # keras_ipu's layers are registered
keras.models.load_model("model_with_popnn_layers.keras")
```
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading

# Each imports the one before it: importing the last registers every layer.
REGISTERING_MODULES = ("keras_ipu.keras.group_normalization", "keras_ipu.keras.layers",
                       "keras_ipu.keras.recurrent_ops")
_LOCK = threading.Lock()
_deferred = threading.Event()  # Keras came while a registering module was being imported
_finished: set[str] = set()  # the registering modules whose import ended


def install() -> None:
    """Registers the layers now if Keras is imported, else once it is.

    Example:

    >>> install()   # keras_ipu's import does it
    """
    if "keras" in sys.modules:
        _register()
        return
    with _LOCK:
        if not any(isinstance(finder, _KerasFinder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _KerasFinder())


def complete(module: str) -> None:
    """The registration Keras' import deferred: each registering module calls it last.

    The outermost registering module being imported does it, once the
    names the others import from it exist.

    Args:
        module: The calling module's name.

    Example:

    >>> complete(__name__)   # the last statement of keras_ipu/keras/layers.py
    """
    _finished.add(module)
    if not _deferred.is_set() or any(name in sys.modules and name not in _finished
                                     for name in REGISTERING_MODULES):
        return
    _deferred.clear()
    importlib.import_module(REGISTERING_MODULES[-1])


def _register() -> None:
    if any(name in sys.modules and name not in _finished for name in REGISTERING_MODULES):
        _deferred.set()  # being imported: they import Keras first
    else:
        importlib.import_module(REGISTERING_MODULES[-1])


class _KerasFinder(importlib.abc.MetaPathFinder):
    """Finds Keras with the finders after it, its loader wrapped (`_KerasLoader`)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "keras":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _KerasLoader(spec.loader, self)
                return spec
        return None


class _KerasLoader(importlib.abc.Loader):
    """Keras' own loader, then the registration (once: the finder then leaves)."""

    def __init__(self, loader, finder: _KerasFinder):
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self._loader
        self._loader.exec_module(module)
        with _LOCK:
            if self._finder in sys.meta_path:
                sys.meta_path.remove(self._finder)
        _register()


__all__ = ["REGISTERING_MODULES", "complete", "install"]
