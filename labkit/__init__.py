"""The course's provided toolbox: loading models, the reference model, benchmarks, the grader.

Nothing in labkit is graded. Every stage imports from it, and no stage imports another stage.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"
TARGET = ASSETS / "tiny-target"
DRAFT = ASSETS / "tiny-draft"
