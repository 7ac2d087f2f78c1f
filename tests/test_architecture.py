"""The folder layout is the architecture: models/ never imports service/, and the service's layers depend only
downwards: routes → use cases → batcher → runtime → model (README, "What is here"; docs/architecture.md).  Read from the
sources' import statements, so a back-edge fails here before anyone has to find it in a review."""

import ast
import importlib
from pathlib import Path

import pytest

from captioner.service.captioning import CaptionParameters
from captioner.service.inputs import caption_parameters
from captioner.service.schemas import CAPTION_OPTIONS, CaptionOptions

from .conftest import ROOT

#: the service's modules by layer, top first; a module may import its own layer's and the layers below it.
#: Modules in no layer (settings, errors, schemas, metrics, ...) are shared definitions any layer may use; ``state``
#: (what routes get by ``Depends``) holds the batchers and the result cache, so it sits with the use cases: a
#: batcher or a runtime that imported it would close a cycle.
SERVICE_LAYERS = {
    "routes": {"app", "cli", "routes", "overlay", "upload_answers", "inputs", "problems", "problem_pages",
               "middleware", "openapi", "security", "lifecycle", "paths"},
    "use cases": {"captioning", "rendering", "results", "result_cache", "archive", "warmup", "state"},
    "batcher": {"batcher", "admission", "row_table"},
    "runtime": {"runtime", "backend_choice", "onnx_exports", "shared_encoders", "onnx_backends"},
}


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, as dotted names (relative imports resolved against ``package``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import batcher`
    return names


def _package_of(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = ["captioner", *relative.parts]
    return ".".join(parts if path.name == "__init__.py" else parts[:-1])


def _service_imports(name: str) -> set[str]:
    path = ROOT / "service" / f"{name}.py"
    prefix = "captioner.service."
    return {m[len(prefix):].split(".")[0] for m in _imported_modules(path, _package_of(path)) if m.startswith(prefix)}


def test_the_layers_name_every_module_they_hold():
    named = set().union(*SERVICE_LAYERS.values())
    assert named <= {p.stem for p in (ROOT / "service").glob("*.py")}


@pytest.mark.parametrize("path", sorted((ROOT / "models").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_models_never_import_the_service(path):
    imported = _imported_modules(path, _package_of(path))
    assert not {m for m in imported if m == "captioner.service" or m.startswith("captioner.service.")}


@pytest.mark.parametrize("layer", list(SERVICE_LAYERS))
def test_service_layers_import_only_downwards(layer):
    order = list(SERVICE_LAYERS)
    above = set().union(*(SERVICE_LAYERS[upper] for upper in order[:order.index(layer)]))
    back_edges = {(name, imported) for name in SERVICE_LAYERS[layer] for imported in _service_imports(name)
                  if imported in above}
    assert not back_edges, f"{layer} imports a layer above it: {sorted(back_edges)}"


def test_the_import_reader_sees_a_back_edge(tmp_path):
    # the checks above pass vacuously if relative imports are misread: resolve one the way the service writes them
    module = tmp_path / "batcher.py"
    module.write_text("from .captioning import caption_image\nfrom . import routes\n")
    assert {"captioner.service.captioning", "captioner.service.routes"} <= _imported_modules(module,
                                                                                              "captioner.service")


def test_the_captioning_use_case_takes_no_wire_model():
    """The use case takes its own parameters (``CaptionParameters``); the HTTP layer translates the wire's
    ``CaptionOptions`` into them (``inputs.caption_parameters``), so a change to the wire format stops there."""
    assert "schemas" not in _service_imports("captioning")
    assert "schemas" not in _service_imports("rendering")  # the heatmaps, too, are written by the HTTP layer
    given = {"model": "m", "beam_size": 2, "max_len": 9, "length_penalty": 0.5, "block_trigrams": True,
             "block_doubled_words": True}
    assert set(given) == set(CAPTION_OPTIONS)  # every wire option is carried over, with its value
    assert caption_parameters(CaptionOptions(**given)) == CaptionParameters(**given)


def _offloads(node: ast.AST) -> str | None:
    """How a call hands blocking work to a thread, when it is one of the ways service/ does not use."""
    if not isinstance(node, ast.Call):
        return None
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    if name == "to_thread":
        return "asyncio.to_thread"
    if name == "run_in_executor" and node.args and isinstance(node.args[0], ast.Constant) \
            and node.args[0].value is None:
        return "the loop's default executor"
    return None


@pytest.mark.parametrize("path", sorted((ROOT / "service").glob("*.py")), ids=lambda p: p.name)
def test_blocking_work_leaves_the_event_loop_one_way(path):
    """One thread pool for the service's blocking calls (Starlette's run_in_threadpool: why in work_slots.py); a
    second way was a second pool with its own limit and other cancellation semantics."""
    other = [(node.lineno, way) for node in ast.walk(ast.parse(path.read_text())) if (way := _offloads(node))]
    assert not other, f"use run_in_threadpool: {other}"


def _exported_names(path: Path) -> list[str] | None:
    """The names a module's ``__all__ = [...]`` lists, read from its source (None without one)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [element.value for element in node.value.elts]
    return None


#: the modules that declare what they export
EXPORTING = sorted(p for d in ("models", "service") for p in (ROOT / d).rglob("*.py") if "__all__ =" in p.read_text())


@pytest.mark.parametrize("path", EXPORTING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_module_exports_is_defined_there(path):
    """``from captioner.service.batcher import *`` (and the docs' API listings) take ``__all__`` at its word: a name
    it lists that the module lacks (a rename that missed it) makes the star import an AttributeError."""
    exported = _exported_names(path)
    assert exported
    name = _package_of(path) if path.name == "__init__.py" else f"{_package_of(path)}.{path.stem}"
    module = importlib.import_module(name)
    assert [name for name in exported if not hasattr(module, name)] == []
