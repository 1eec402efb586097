#!/usr/bin/env python3
"""tools/check_layering.py on small trees: each rule fails when broken, and a clean tree passes."""
import pathlib
import subprocess
import sys
import tempfile
import unittest

CHECK = pathlib.Path(__file__).resolve().parents[2] / "tools" / "check_layering.py"


def run(files):
    with tempfile.TemporaryDirectory() as root:
        for name, text in files.items():
            path = pathlib.Path(root) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        done = subprocess.run([sys.executable, str(CHECK), root], capture_output=True, text=True)
        return done.returncode, done.stderr


CLEAN = {
    "core/CMakeLists.txt": "accel_component(NAME core SOURCES status.cc)\n",
    "core/status.h": "",
    "loader/CMakeLists.txt": "accel_component(NAME loader SOURCES a.cc PUBLIC_DEPS accel::core)\n",
    "loader/a.cc": '#include "core/status.h"\n',
    "proto/accel/v1/generation.proto": "",
    "server/CMakeLists.txt": ("accel_component(NAME server SOURCES s.cc\n"
                              "  PUBLIC_DEPS accel::proto accel::models)\n"),
    "server/s.cc": '#include "accel/v1/generation.grpc.pb.h"\n#include "models/m.h"\n',
    "proto/CMakeLists.txt": "add_library(accel_proto STATIC x)\nadd_library(accel::proto ALIAS accel_proto)\n",
    "models/CMakeLists.txt": "accel_component(NAME models SOURCES m.cc PUBLIC_DEPS accel::loader)\n",
    "models/m.h": "",
    "models/m.cc": '#include "loader/a.h"\n',
}


class CheckLayeringTest(unittest.TestCase):
    def test_clean_tree_passes(self):
        rc, err = run(CLEAN)
        self.assertEqual(rc, 0, err)

    def test_unused_cmake_dependency_fails(self):
        files = dict(CLEAN)
        files["loader/a.cc"] = "int x;\n"
        rc, err = run(files)
        self.assertEqual(rc, 1)
        self.assertIn("loader/CMakeLists.txt links core/, but no file in loader/", err)

    def test_unlinked_include_fails(self):
        files = dict(CLEAN)
        files["server/CMakeLists.txt"] = "accel_component(NAME server SOURCES s.cc PUBLIC_DEPS accel::models)\n"
        rc, err = run(files)
        self.assertEqual(rc, 1)
        self.assertIn("server/ includes headers of proto/, but server/CMakeLists.txt does not link it", err)

    def test_upward_include_fails(self):
        files = dict(CLEAN)
        files["loader/b.cc"] = '#include "models/m.h"\n'
        rc, err = run(files)
        self.assertEqual(rc, 1)
        self.assertIn("loader/ may not include models/m.h", err)

    def test_internal_header_of_another_component_fails(self):
        files = dict(CLEAN)
        files["bench/models/b.cc"] = '#include "loader/internal/x.h"\n'
        rc, err = run(files)
        self.assertEqual(rc, 1)
        self.assertIn("bench/models/b.cc: includes loader/internal/x.h, internal to loader/", err)

    def test_benchmark_follows_its_component(self):
        files = dict(CLEAN)
        files["bench/loader/b.cc"] = '#include "models/m.h"\n'
        rc, err = run(files)
        self.assertEqual(rc, 1)
        self.assertIn("bench/loader/b.cc: loader/ may not include models/m.h", err)

    def test_the_engine_sits_between_models_and_server(self):
        files = dict(CLEAN)
        files["engine/CMakeLists.txt"] = "accel_component(NAME engine SOURCES e.cc PUBLIC_DEPS accel::models)\n"
        files["engine/e.h"] = ""
        files["engine/e.cc"] = '#include "models/m.h"\n'
        files["server/CMakeLists.txt"] = ("accel_component(NAME server SOURCES s.cc\n"
                                          "  PUBLIC_DEPS accel::proto accel::engine)\n")
        files["server/s.cc"] = '#include "accel/v1/generation.grpc.pb.h"\n#include "engine/e.h"\n'
        rc, err = run(files)
        self.assertEqual(rc, 0, err)
        files["engine/e.cc"] = '#include "models/m.h"\n#include "server/s.h"\n'
        rc, err = run(files)
        self.assertEqual(rc, 1)
        self.assertIn("engine/ may not include server/s.h", err)
        files["engine/e.cc"] = '#include "models/m.h"\n'
        files["models/m.cc"] = '#include "loader/a.h"\n#include "engine/e.h"\n'
        rc, err = run(files)
        self.assertEqual(rc, 1)
        self.assertIn("models/ may not include engine/e.h", err)


if __name__ == "__main__":
    unittest.main()
