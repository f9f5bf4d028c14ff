"""Import paths of the 0.1 layout, kept for one release: each resolves to the name's new home with a DeprecationWarning.

grpo-lens 0.1 had twenty top-level modules and a ``diagnostics`` package; 0.2 groups them by role (formulas,
gradients, analysis, train, probe, claims, report). Code written against 0.1, e.g.
``from grpo_lens.advantages import compute_advantages`` or ``from grpo_lens import diagnostics as dg;
dg.rank_measures(...)``, keeps working: :func:`install` (called by ``grpo_lens/__init__.py``) adds a finder that
answers the old module names with a module whose attributes are looked up, on first use, in the modules listed for it
in :data:`MOVED_MODULES`. Names that left a module which still exists (``grpo_lens.lora.lora_rollout_grads``) or were
renamed are in :data:`MOVED_NAMES`, served by :func:`moved_attribute` from that module's ``__getattr__``.

The next release removes this file.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

#: old module -> the modules its public names live in now, searched in this order
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "grpo_lens.advantages": ("grpo_lens.formulas.advantages",),
    "grpo_lens.losses": ("grpo_lens.formulas.losses",),
    "grpo_lens.overlong": ("grpo_lens.formulas.overlong",),
    "grpo_lens.claims_measures": ("grpo_lens.claims.sparsity", "grpo_lens.claims.credit", "grpo_lens.claims.baselines",
                                  "grpo_lens.claims.base", "grpo_lens.formulas.stats"),
    "grpo_lens.compare": ("grpo_lens.report.compare",),
    "grpo_lens.report.gradient_measures": ("grpo_lens.report.training_measures", "grpo_lens.report.studies"),
    "grpo_lens.dynamic_sampling": ("grpo_lens.train.dynamic_sampling", "grpo_lens.report.training_measures"),
    "grpo_lens.lens": ("grpo_lens.train.lens", "grpo_lens.train.processes", "grpo_lens.formulas.advantages",
                       "grpo_lens.rundir"),
    "grpo_lens.studies": ("grpo_lens.probe.studies",),
    "grpo_lens.trainer": ("grpo_lens.train.loop", "grpo_lens.train.update", "grpo_lens.train.step_metrics",
                          "grpo_lens.train.processes", "grpo_lens.train.memory", "grpo_lens.rollout"),
    "grpo_lens.diagnostics": ("grpo_lens.analysis.group", "grpo_lens.formulas.spectrum", "grpo_lens.formulas.zero_sum",
                              "grpo_lens.formulas.identity", "grpo_lens.formulas.baselines",
                              "grpo_lens.formulas.sparsity", "grpo_lens.formulas.credit", "grpo_lens.formulas.stats",
                              "grpo_lens.formulas.sketch_error", "grpo_lens.gradients.exact",
                              "grpo_lens.gradients.sketch", "grpo_lens.gradients.params", "grpo_lens.gradients.scores",
                              "grpo_lens.gradients.g2", "grpo_lens.train.sparsity"),
    "grpo_lens.diagnostics.baseline_study": ("grpo_lens.formulas.baselines", "grpo_lens.formulas.stats"),
    "grpo_lens.diagnostics.baselines": ("grpo_lens.formulas.baselines", "grpo_lens.formulas.losses",
                                        "grpo_lens.gradients.sketch"),
    "grpo_lens.diagnostics.credit": ("grpo_lens.formulas.credit",),
    "grpo_lens.diagnostics.gradients": ("grpo_lens.gradients.exact", "grpo_lens.gradients.sketch",
                                        "grpo_lens.gradients.params", "grpo_lens.gradients.scores",
                                        "grpo_lens.formulas.sketch_error", "grpo_lens.formulas.spectrum"),
    "grpo_lens.diagnostics.group": ("grpo_lens.analysis.group", "grpo_lens.formulas.spectrum",
                                    "grpo_lens.formulas.zero_sum", "grpo_lens.gradients.g2"),
    "grpo_lens.diagnostics.identity": ("grpo_lens.formulas.identity",),
    "grpo_lens.diagnostics.sparsity": ("grpo_lens.formulas.sparsity", "grpo_lens.train.sparsity"),
    "grpo_lens.diagnostics.sparsity_training": ("grpo_lens.formulas.sparsity", "grpo_lens.train.sparsity"),
    "grpo_lens.diagnostics.spectrum": ("grpo_lens.formulas.spectrum",),
    "grpo_lens.diagnostics.stats": ("grpo_lens.formulas.stats",),
    "grpo_lens.diagnostics.token_credit": ("grpo_lens.formulas.credit", "grpo_lens.gradients.token_credit"),
}

#: "old module:name" -> "new module:name", for names that left a module that still exists, or were renamed
MOVED_NAMES: dict[str, str] = {
    "grpo_lens.diagnostics:layer_type": "grpo_lens.gradients.g2:module_kind",
    "grpo_lens.diagnostics.group:layer_type": "grpo_lens.gradients.g2:module_kind",
    "grpo_lens.lora:lora_rollout_grads": "grpo_lens.gradients.lora_spaces:lora_rollout_grads",
    "grpo_lens.lora:adapter_layers": "grpo_lens.gradients.lora_spaces:adapter_layers",
    "grpo_lens.lora:base_layers": "grpo_lens.gradients.lora_spaces:base_layers",
    "grpo_lens.probe:analyse_group": "grpo_lens.probe.run:measure_group",
    "grpo_lens.probe:STRATA_KEYS": "grpo_lens.probe.run:STRATA_KEYS",
    "grpo_lens.probe:default_layer": "grpo_lens.probe.run:default_layer",
    "grpo_lens.probe:g2_weightings": "grpo_lens.probe.run:g2_weightings",
    "grpo_lens.probe:probe_group_size": "grpo_lens.probe.run:probe_group_size",
    "grpo_lens.probe:run_studies": "grpo_lens.probe.run:run_studies",
    "grpo_lens.probe:score_weights": "grpo_lens.probe.run:score_weights",
    "grpo_lens.probe:sketch_check": "grpo_lens.probe.run:sketch_check",
    "grpo_lens.claims:ClaimFn": "grpo_lens.claims.base:ClaimFn",
    "grpo_lens.claims:MIN_GROUPS": "grpo_lens.claims.base:MIN_GROUPS",
    "grpo_lens.claims:band_verdict": "grpo_lens.claims.base:band_verdict",
    "grpo_lens.claims:source_of": "grpo_lens.claims.base:source_of",
    "grpo_lens.claims:ERANK_BAND": "grpo_lens.claims.rank:ERANK_BAND",
    "grpo_lens.claims:erank_near_two": "grpo_lens.claims.rank:erank_near_two",
    "grpo_lens.claims:IDENTITY_TOLERANCE": "grpo_lens.claims.identity:IDENTITY_TOLERANCE",
    "grpo_lens.claims:identity_claim": "grpo_lens.claims.identity:identity_claim",
    "grpo_lens.claims:NEGLIGIBLE_SHARE": "grpo_lens.claims.zero_sum:NEGLIGIBLE_SHARE",
    "grpo_lens.claims:NOT_ZERO_SUM": "grpo_lens.claims.zero_sum:NOT_ZERO_SUM",
    "grpo_lens.claims:zero_sum_rank_two": "grpo_lens.claims.zero_sum:zero_sum_rank_two",
    "grpo_lens.claims:zero_sum_g2_weighting": "grpo_lens.claims.zero_sum:zero_sum_g2_weighting",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} in grpo-lens 0.2; import it from there (the old path goes in the next "
                  f"release)", DeprecationWarning, stacklevel=3)


def moved_attribute(module: str, name: str) -> Any:
    """The object ``module.name`` used to be, from its new home (:data:`MOVED_NAMES`), with a DeprecationWarning.

    Raises:
        AttributeError: ``name`` never was an attribute of ``module``.
    """
    new = MOVED_NAMES.get(f"{module}:{name}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, new_name = new.split(":")
    _warn(f"{module}.{name}", f"{new_module}.{new_name}")
    value = getattr(importlib.import_module(new_module), new_name)
    vars(sys.modules[module])[name] = value  # warn once; later look-ups find it directly
    return value


class _MovedModule(types.ModuleType):
    """An old module path: attributes come from the modules of :data:`MOVED_MODULES` (first that has the name)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if f"{self.__name__}:{name}" in MOVED_NAMES:
            return moved_attribute(self.__name__, name)
        for target in MOVED_MODULES[self.__name__]:
            module = importlib.import_module(target)
            if hasattr(module, name):
                value = getattr(module, name)
                setattr(self, name, value)
                return value
        raise AttributeError(f"{self.__name__!r} (moved to {', '.join(MOVED_MODULES[self.__name__])}) has no "
                             f"attribute {name!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in MOVED_MODULES[self.__name__]:
            names.update(n for n in dir(importlib.import_module(target)) if not n.startswith("_"))
        return sorted(names)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the module names of :data:`MOVED_MODULES` with a :class:`_MovedModule`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        is_package = any(other.startswith(fullname + ".") for other in MOVED_MODULES)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MovedModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__ is not None and module.__spec__.submodule_search_locations is not None:
            module.__path__ = []
        targets = MOVED_MODULES[module.__name__]
        packages = sorted({t.rsplit(".", 1)[0] for t in targets})
        _warn(module.__name__, " / ".join(targets) if len(targets) <= 3 else f"modules of {', '.join(packages)}")


def install() -> None:
    """Put the finder for the old module paths on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
