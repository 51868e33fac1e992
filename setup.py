"""Build shim: metadata lives in pyproject.toml.

Native kernels in csrc/ are optional; they are built separately by CMake (see
CMakeLists.txt) and loaded when present, with pure-torch fallbacks always available.
"""

from setuptools import setup

setup()
