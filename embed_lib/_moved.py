"""The flat module paths of embed_lib 0.1 (`embed_lib.tasks`, `embed_lib.study`, ...) keep working for one release:
importing one warns (DeprecationWarning, naming the new module) and returns a module whose names come from the
modules they moved to. Remove after 0.2."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: old module -> the modules its names live in now (a split module has several)
MOVED = {
    "tasks": ["data.tasks"], "custom_tasks": ["data.custom_tasks"],
    "batching": ["encoding.batching"], "encoders": ["encoding.encoders", "encoding.weights"],
    "onnx_backend": ["encoding.onnx_backend"], "cache": ["encoding.cache"],
    "signals": ["training.signals"], "adapters": ["training.adapters"], "losses": ["training.losses"],
    "metrics": ["training.metrics"], "study_data": ["training.tensors"], "train": ["training.seed_group"],
    "selection": ["training.selection"], "diagnostics": ["training.diagnostics"], "export": ["training.export"],
    "cascade": ["training.cascade"], "retrieval": ["training.retrieval", "pipeline.prepare"],
    "teacher_fit": ["teacher.recipe"], "teacher_intermediate": ["teacher.intermediate", "teacher.config"],
    "cross_encoder": ["teacher.cross_encoder", "tracking.cross_encoder_registry"],
    "distributed": ["pipeline.distributed"], "study": ["report.study", "pipeline.prepare"],
    "registry": ["tracking.registry"], "promotion": ["tracking.promotion"],
    "mlflow_model": ["tracking.pyfunc_adapter"], "mlflow_cross_encoder": ["tracking.pyfunc_cross_encoder"],
    "cli_args": ["cli.args"], "commands": ["cli.commands"],
}


class _Bridge(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        head, _, old = fullname.partition(".")
        if head == "embed_lib" and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = [f"embed_lib.{m}" for m in MOVED[spec.name.split(".", 1)[1]]]
        warnings.warn(f"{spec.name} moved to {' and '.join(new)}; the old path goes in embed_lib 0.2.",
                      DeprecationWarning, stacklevel=3)
        module = types.ModuleType(spec.name, f"Moved: see {', '.join(new)}.")
        sources = [importlib.import_module(m) for m in new]

        def __getattr__(name):
            for src in sources:
                if hasattr(src, name):
                    return getattr(src, name)
            raise AttributeError(f"{spec.name} (moved to {', '.join(new)}) has no attribute {name!r}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Bridge) for f in sys.meta_path):
        sys.meta_path.append(_Bridge())


def package_getattr(package: str, modules: list[str]):
    """A module `__getattr__` for a package that took the name of an old flat module (`embed_lib.teacher`,
    `embed_lib.tracking`, `embed_lib.cli`): the old module's names still resolve, with a DeprecationWarning."""
    def __getattr__(name: str):
        # a submodule not imported yet (`from package import submodule`) is the import system's to load: looking for
        # it among the old module's names would import those modules first, and they may import the submodule
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is None:
            for m in modules:
                module = importlib.import_module(f"{package}.{m}")
                if hasattr(module, name):
                    warnings.warn(f"{package}.{name} moved to {package}.{m}.{name}; the old path goes in embed_lib "
                                  "0.2.", DeprecationWarning, stacklevel=2)
                    return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
