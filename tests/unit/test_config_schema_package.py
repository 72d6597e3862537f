"""The job schema package stays one map: every section model a job composes is re-exported by
``runtime.config.schema`` (callers in other packages import from there), and the package
docstring names each of its modules.

Both read the code as it is (the models through pydantic, the docstring with ast): a section
added in a new module without its export or its line fails here.
"""

from __future__ import annotations

import ast
import types
import typing
from pathlib import Path

from pydantic import BaseModel

import runtime.config.schema as schema
from runtime.config.schema import JobConfig

PACKAGE = Path(schema.__file__).parent


def section_models(model: type[BaseModel]) -> set[type[BaseModel]]:
    """``model`` and every model reachable through its fields' types (unions and lists included)."""
    found = {model}
    for field in model.model_fields.values():
        pending: list[typing.Any] = [field.annotation]
        while pending:
            ann = pending.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                found |= section_models(ann) if ann not in found else set()
            elif isinstance(ann, types.UnionType) or typing.get_origin(ann) is not None:
                pending += typing.get_args(ann)
    return found


def test_every_section_model_a_job_composes_is_exported_by_the_schema_package() -> None:
    composed = {m.__name__: m for m in section_models(JobConfig)}
    exported = {name: getattr(schema, name) for name in schema.__all__ if isinstance(getattr(schema, name), type)}
    assert exported == composed, (f"not exported: {sorted(set(composed) - set(exported))}; "
                                  f"exported but composed by no job: {sorted(set(exported) - set(composed))}")


def test_walk_finds_models_inside_unions_and_lists() -> None:
    class Leaf(BaseModel):
        x: int = 0

    class Other(BaseModel):
        y: int = 0

    class Root(BaseModel):
        a: int | Leaf = 0
        b: list[Other] = []

    assert section_models(Root) == {Root, Leaf, Other}


def test_schema_docstring_names_each_of_its_modules() -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    unnamed = [p.stem for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__" and f"``{p.stem}``" not in doc]
    assert not unnamed, f"modules of runtime/config/schema/ missing from its docstring: {unnamed}"
