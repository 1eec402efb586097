#!/usr/bin/env python3
"""Fails when an #include goes against the component graph of docs/ARCHITECTURE.md.

core <- {loader, quant} <- dispatch <- models <- server -> proto; dispatch <- train;
examples use models and train.
A component may include its own headers and those of the components it depends
on (transitively), never another component's internal/ headers. Tests, tools
and benchmarks of a component follow the same rule as the component.
"""
import pathlib
import re
import sys

DEPS = {
    "core": set(),
    "jinja": {"core"},
    "loader": {"core"},
    "quant": {"core"},
    "dispatch": {"core", "loader", "quant"},
    "models": {"core", "loader", "quant", "dispatch"},
    "train": {"core", "loader", "quant", "dispatch"},
    "server": {"core", "loader", "quant", "dispatch", "models", "proto"},
    "proto": set(),
    "examples": {"core", "loader", "quant", "dispatch", "models", "train"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def component_of(path: pathlib.PurePath):
    parts = path.parts
    if parts[0] in ("tests", "bench") and len(parts) > 1 and parts[1] in DEPS:
        return parts[1]
    return parts[0] if parts[0] in DEPS else None


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent
    errors = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cc") or any(p.startswith("build") for p in path.relative_to(root).parts):
            continue
        rel = path.relative_to(root)
        owner = component_of(rel)
        for included in INCLUDE.findall(path.read_text(errors="replace")):
            target = included.split("/")[0]
            if target not in DEPS:
                continue  # tests/testing, third-party, generated
            internal = "/internal/" in included
            if owner is None:
                if internal and rel.parts[0] != "tests":
                    errors.append(f"{rel}: includes {included}, an internal header")
                continue
            if target == owner:
                continue
            if internal:
                errors.append(f"{rel}: includes {included}, internal to {target}/")
            elif target not in DEPS[owner]:
                errors.append(f"{rel}: {owner}/ may not include {included} ({target}/ is not below it)")
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
