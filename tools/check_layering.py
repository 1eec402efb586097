#!/usr/bin/env python3
"""Checks the component graph of docs/ARCHITECTURE.md against the code, both ways.

1. Every #include goes down the graph: a component includes its own headers and
   those of the components below it, never another component's internal/
   headers. Tests (tests/<component>/) and benchmarks (bench/<component>/)
   follow their component's rule. The generated proto headers
   ("accel/v1/generation.pb.h", ...) belong to proto/.
2. The CMake dependencies are measured, not allowed: a component's
   CMakeLists.txt may link another component only when some file of the
   component includes a header of it (an unused link is an error), and a
   component that includes another's header must link it, directly or through
   what it links.
"""
import pathlib
import re
import sys

# The graph: each component and the components directly below it.
BELOW = {
    "core": set(),
    "jinja": {"core"},
    "tokenizer": {"core", "jinja"},
    "grammar": {"core", "jinja", "tokenizer"},
    "loader": {"core"},
    "quant": {"core"},
    "dispatch": {"core", "loader", "quant"},
    "dist": {"core"},
    "models": {"core", "tokenizer", "loader", "quant", "dispatch", "dist"},
    "engine": {"core", "tokenizer", "loader", "quant", "dispatch", "models", "grammar"},
    "train": {"core", "tokenizer", "loader", "quant", "dispatch", "dist"},
    "proto": set(),
    "server": {"engine", "proto"},
    "examples": {"models", "train"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
CMAKE_TARGET = re.compile(r"\baccel(?:::|_)(\w+)")
SKIP_DIRS = ("build", ".git", "node_modules")


def closure(graph):
    """Each component with everything below it, transitively."""
    result = {}

    def below(name, seen=()):
        if name in result:
            return result[name]
        found = set()
        for dep in graph.get(name, ()):
            if dep in seen:
                continue
            found |= {dep} | below(dep, seen + (name,))
        result[name] = found
        return found

    for name in graph:
        below(name)
    return result


ALLOWED = closure(BELOW)


def proto_headers(root: pathlib.Path):
    """The generated headers of proto/: "<path>.pb.h" and "<path>.grpc.pb.h"."""
    headers = set()
    for proto in (root / "proto").rglob("*.proto"):
        stem = proto.relative_to(root / "proto").with_suffix("").as_posix()
        headers |= {stem + ".pb.h", stem + ".grpc.pb.h"}
    return headers


def component_of(path: pathlib.PurePath):
    parts = path.parts
    if parts[0] in ("tests", "bench") and len(parts) > 1 and parts[1] in BELOW:
        return parts[1]
    return parts[0] if parts[0] in BELOW else None


def included_component(included: str, generated):
    if included in generated:
        return "proto"
    top = included.split("/")[0]
    return top if top in BELOW else None


def cmake_targets(root: pathlib.Path):
    """Target name (what follows accel_ / accel::) -> the component that defines it."""
    owner = {}
    for name in BELOW:
        cmake = root / name / "CMakeLists.txt"
        if not cmake.exists():
            continue
        text = strip_comments(cmake.read_text())
        for lib in re.findall(r"add_library\(\s*accel_(\w+)", text):
            owner[lib] = name
        for lib in re.findall(r"accel_component\(\s*NAME\s+(\w+)", text):
            owner[lib] = name
        for alias in re.findall(r"add_library\(\s*accel::(\w+)\s+ALIAS", text):
            owner[alias] = name
    return owner


def strip_comments(cmake_text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in cmake_text.splitlines())


def main() -> int:
    # The repository root, or the folder given (tests check small trees of their own).
    root = (pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else
            pathlib.Path(__file__).resolve().parent.parent).resolve()
    generated = proto_headers(root)
    errors = []
    used = {name: set() for name in BELOW}  # what each component's own files include
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.suffix not in (".h", ".cc") or any(
                p.startswith(SKIP_DIRS) for p in rel.parts):
            continue
        owner = component_of(rel)
        in_component = owner is not None and rel.parts[0] == owner
        for included in INCLUDE.findall(path.read_text(errors="replace")):
            target = included_component(included, generated)
            if target is None:
                continue  # tests/testing, bench helpers, third-party
            internal = "/internal/" in included
            if owner is None:
                if internal and rel.parts[0] != "tests":
                    errors.append(f"{rel}: includes {included}, an internal header")
                continue
            if target == owner:
                continue
            if internal:
                errors.append(f"{rel}: includes {included}, internal to {target}/")
            elif target not in ALLOWED[owner]:
                errors.append(
                    f"{rel}: {owner}/ may not include {included} ({target}/ is not below it)")
            elif in_component:
                used[owner].add(target)

    # The CMake side: what each component links, against what it includes.
    owner_of_target = cmake_targets(root)
    declared = {}
    for name in BELOW:
        cmake = root / name / "CMakeLists.txt"
        if not cmake.exists():
            continue
        text = strip_comments(cmake.read_text())
        linked = {owner_of_target[t] for t in CMAKE_TARGET.findall(text) if t in owner_of_target}
        declared[name] = linked - {name}
    reachable = closure(declared)
    for name in sorted(declared):
        for dep in sorted(declared[name] - used[name]):
            errors.append(f"{name}/CMakeLists.txt links {dep}/, but no file in {name}/ "
                          f"includes a header of {dep}/: remove the dependency")
        for dep in sorted(used[name] - reachable.get(name, set())):
            errors.append(f"{name}/ includes headers of {dep}/, but {name}/CMakeLists.txt "
                          f"does not link it (directly or through what it links)")
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
