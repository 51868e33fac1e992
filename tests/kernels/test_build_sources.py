"""Both builds of the native kernels compile the same sources: CMakeLists.txt globs a
pattern of csrc/, the JIT build (``vllm._custom_ops``) globs csrc/cpu; no file is named in
one list only."""

from __future__ import annotations

import re
from pathlib import Path

from vllm import _custom_ops as ops

ROOT = Path(__file__).resolve().parents[2]


def test_cmake_and_the_jit_build_compile_the_same_sources():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    globs = re.findall(r"file\(GLOB\s+VLLM_C_SOURCES\s+CONFIGURE_DEPENDS\s+\"([^\"]+)\"\)", cmake)
    assert len(globs) == 1, "CMakeLists.txt should glob its sources into VLLM_C_SOURCES"
    pattern = globs[0].replace("${CMAKE_SOURCE_DIR}/", "")
    assert "add_library(_C MODULE ${VLLM_C_SOURCES})" in cmake
    assert not re.search(r"\w+\.cpp\b", cmake.replace(globs[0], "")), "a source named by hand"
    assert sorted(ROOT.glob(pattern)) == ops._SOURCES
    assert ops._SOURCES and all(src.suffix == ".cpp" for src in ops._SOURCES)
