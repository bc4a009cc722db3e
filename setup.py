# Metadata lives in pyproject.toml; this file keeps `pip install -e .` working with old tooling.
from setuptools import setup

setup()
